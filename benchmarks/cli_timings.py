"""How long the commands on a saved trace take, start to exit, in fresh processes.

    python benchmarks/cli_timings.py                          # this checkout, 15 rounds
    python benchmarks/cli_timings.py --root before=/tmp/base --root after=. --out cli.md

Makes a trace of about 1 MB once (a model of ``--layers`` residual blocks of Linear, GELU and
LayerNorm, one step with AdamW, ``hash="md5"``: the default trace) and a second one of another seed for ``diff``,
then times ``python -m tracer COMMAND ...`` (what the ``gradtrace`` script runs) for
``--help``, ``summary``, ``show``, ``md5``, ``dot``, ``report`` and ``diff``, each in a process
of its own with its output thrown away. Every round runs each command under each ``--root``
(a source tree put first on ``PYTHONPATH``: two checkouts compared in one run), in an order
rotated every round, so a noisy shared machine's drift falls on all of them alike. Prints the
median wall time of each, the spread (min-max) and whether the command imported torch (read
once from ``python -X importtime``). The targets (issue 44): ``summary`` of a 1 MB trace under
1 s and ``--help`` under 0.5 s on the 2-core CPU machine.

Bytecode: by default each run reads the modules' bytecode from a scratch cache written by one
untimed run of each command (``PYTHONPYCACHEPREFIX``), as an installed gradtrace does.
``--compile`` compiles every module on every run instead (``PYTHONDONTWRITEBYTECODE=1``: how a
source checkout runs where that is set, as on the shared CPU machine), which adds ~0.05 s there.

The trace is made on the CPU (``--device cuda`` makes it on a GPU: the commands read the same
file format either way).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

MAKE_TRACE = """
import sys, torch, tracer
seed, layers, device, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.norm = torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.LayerNorm(32)

    def forward(self, x):
        return x + self.norm(self.act(self.fc(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


torch.manual_seed(seed)
model = Net().to(device)
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(8, 32, device=device)
with tracer.trace(out=out):
    model(x).pow(2).mean().backward()
    opt.step()
"""


def commands(a: str, b: str, scratch: str) -> dict[str, list[str]]:
    """What each timed command runs (after ``python -m tracer``)."""
    return {
        "--help": ["--help"],
        "summary": ["summary", a],
        "show": ["show", a, "linear3"],
        "md5": ["md5", a],
        "dot": ["dot", a, "-o", os.path.join(scratch, "step.dot"), "--force"],
        "report": ["report", a, "-o", os.path.join(scratch, "step.html"), "--force"],
        "diff": ["diff", a, b],
    }


def make_traces(root: str, layers: int, device: str, where: str) -> tuple[str, str]:
    paths = []
    for seed in (0, 1):
        path = os.path.join(where, f"seed{seed}.gtrace")
        subprocess.run([sys.executable, "-c", MAKE_TRACE, str(seed), str(layers), device, path],
                       env=_env(root), check=True)
        paths.append(path)
    return paths[0], paths[1]


def _env(root: str, pycache: str | None = None) -> dict[str, str]:
    """The environment of a timed run: ``root`` first on the path; with ``pycache``, bytecode
    written to and read from there (as an installed package has it), else compiled every run."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    env.update(PYTHONPATH=os.path.abspath(root), GRADTRACE_PROGRESS="0")
    if pycache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def run_once(root: str, words: Sequence[str], pycache: str | None) -> float:
    """Seconds from start to exit of one ``python -m tracer WORDS`` (its exit status checked:
    0, or 1 for a diff that found a difference)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tracer", *words], env=_env(root, pycache),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(words)} under {root} failed ({proc.returncode}): {proc.stderr.decode()[-400:]}")
    return seconds


def imports_torch(root: str, words: Sequence[str]) -> bool:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tracer", *words], env=_env(root),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in proc.stderr.splitlines())


def measure(roots: dict[str, str], table: dict[str, list[str]], rounds: int,
            pycache: str | None) -> dict[tuple[str, str], list[float]]:
    cases = [(label, name) for name in table for label in roots]
    times: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    for case in cases:  # one untimed run each (with pycache: the bytecode is written)
        run_once(roots[case[0]], table[case[1]], pycache)
    for r in range(rounds):
        shift = r % len(cases)
        for label, name in cases[shift:] + cases[:shift]:
            times[(label, name)].append(run_once(roots[label], table[name], pycache))
    return times


def report(roots: dict[str, str], table: dict[str, list[str]], times: dict[tuple[str, str], list[float]],
           torch_used: dict[tuple[str, str], bool], header: str) -> str:
    labels = list(roots)
    lines = [header, "", "| command | " + " | ".join(f"{lb}: median s (min-max), torch?" for lb in labels) + " |",
             "|---|" + "---|" * len(labels)]
    for name in table:
        cells = []
        for lb in labels:
            xs = times[(lb, name)]
            cells.append(f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f}), "
                         f"{'imports torch' if torch_used[(lb, name)] else 'no torch'}")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_all(roots: dict[str, str], args: argparse.Namespace, scratch: str) -> str:
    """Make the traces, time every command under every root; the report."""
    a, b = make_traces(list(roots.values())[-1], args.layers, args.device, scratch)
    table = commands(a, b, scratch)
    torch_used = {(lb, name): imports_torch(root, table[name]) for lb, root in roots.items() for name in table}
    pycache = None if args.compile else os.path.join(scratch, "pycache")
    times = measure(roots, table, args.rounds, pycache)
    bytecode = "every module compiled on every run" if args.compile else "bytecode cached"
    header = (f"`python -m tracer COMMAND` on a {os.path.getsize(a) / 1e6:.2f} MB trace ({args.layers} blocks, "
              f"one AdamW step, md5), {args.rounds} rounds, {bytecode}, {os.cpu_count()} CPUs, Python "
              f"{sys.version.split()[0]}; wall seconds per run, start to exit")
    return report(roots, table, times, torch_used, header)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", action="append", metavar="[LABEL=]DIR",
                   help="a source tree to time (repeatable; default: this checkout)")
    p.add_argument("--rounds", type=int, default=15, help="timed runs of each command under each root (default 15)")
    p.add_argument("--layers", type=int, default=54, help="residual blocks of the traced model "
                                                          "(54: a trace of about 1 MB)")
    p.add_argument("--device", default="cpu", help="where the traced step runs (cpu, cuda)")
    p.add_argument("--compile", action="store_true",
                   help="compile every module on every run (PYTHONDONTWRITEBYTECODE=1, as a source checkout runs "
                        "where that is set); default: bytecode cached in a scratch folder, as an installed package")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    args = p.parse_args(argv)
    roots: dict[str, str] = {}
    for spec in args.root or [f"this={REPO}"]:
        label, _, path = spec.rpartition("=")
        roots[label or os.path.basename(os.path.abspath(path))] = os.path.abspath(path)
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        # `python -m` and `python -c` put the working directory first on sys.path: a checkout's own
        # tracer/ there would stand in for every --root's.
        os.chdir(scratch)
        try:
            text = run_all(roots, args, scratch)
        finally:
            os.chdir(here)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
