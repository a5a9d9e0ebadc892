"""Are the traces of two source trees the same? Records of real workloads, compared byte for byte.

A change to the recorder's hot path must leave every trace as it was. This script traces the
tiny workloads of ``workloads.py`` under each source tree (each tree first on ``PYTHONPATH``,
in a process of its own), saves every trace as JSON lines and compares the two trees' files
record by record, printing the first difference of each. The meta record's host, pid, times and
command line (``host``, ``pid``, ``started``, ``seconds``, ``argv``) are left out: they differ between any two runs.

    mkdir -p /tmp/base && git archive c7cecfa tracer | tar -x -C /tmp/base
    python benchmarks/trace_equality.py --base /tmp/base --new .
    python benchmarks/trace_equality.py --base /tmp/base --new . --models tiny --configs fast,md5

Both trees run this same script (the user's frames in the stacks are its own and
``workloads.py``'s), in the same folder, so only the recorder differs. Exit status 0 when every
trace is the same, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MODELS = ["tiny", "resnet50-tiny", "llama-tiny", "vit-tiny", "bert-tiny"]
CONFIGS = ["names-links", "stacks", "fast", "md5", "check_numerics"]
# Fields of the meta record that differ between any two runs of the same program (the command
# line names each tree's output folder).
VOLATILE_META = ("host", "pid", "started", "seconds", "argv")


def _sessions() -> dict[str, Callable[[], Any]]:
    import tracer  # (the tree under test: imported in the child only, after PYTHONPATH is set)

    return {
        "names-links": lambda: tracer.trace(hash="none", stacks=False),
        "stacks": lambda: tracer.trace(hash="none", stacks=True),
        "fast": lambda: tracer.trace(hash="fast"),
        "md5": lambda: tracer.trace(hash="md5"),
        "check_numerics": lambda: tracer.check_numerics(),
    }


def canonical_lines(path: Path) -> list[str]:
    """The saved records of a trace, one JSON text each, the meta record without its volatile fields."""
    lines = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("t") == "meta":
            line = json.dumps({k: v for k, v in record.items() if k not in VOLATILE_META}, separators=(",", ":"))
        lines.append(line)
    return lines


def dump(out: Path, models: list[str], configs: list[str], steps: int) -> None:
    """(In the child.) Trace ``steps`` steps of each model under each configuration and save each trace."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workloads import build  # a sibling script, not a package

    torch.set_num_threads(1)
    sessions = _sessions()
    for model in models:
        for config in configs:
            # A fresh workload per configuration: the same weights, inputs and RNG state in both trees.
            w = build(model, torch.device("cpu"), None, None)
            with sessions[config]() as t:
                for _ in range(steps):
                    w.step()
            t.save(str(out / f"{model}.{config}.jsonl"))


def run_tree(tree: Path, out: Path, args: argparse.Namespace) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--dump", str(out), "--models", args.models,
           "--configs", args.configs, "--steps", str(args.steps)]
    return subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parent, capture_output=True, text=True)


def first_difference(a: list[str], b: list[str]) -> str | None:
    """Where two traces' records first differ, with both records; None when they are the same."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"record {i + 1}:\n  base: {x[:600]}\n  new:  {y[:600]}"
    if len(a) != len(b):
        return f"base has {len(a)} records, new has {len(b)}"
    return None


def compare(base: Path, new: Path, models: list[str], configs: list[str]) -> int:
    differing = 0
    for model in models:
        for config in configs:
            name = f"{model}.{config}.jsonl"
            a, b = canonical_lines(base / name), canonical_lines(new / name)
            diff = first_difference(a, b)
            if diff is None:
                print(f"same       {model:14} {config:15} {len(a):6} records")
            else:
                differing += 1
                print(f"DIFFERENT  {model:14} {config:15} {diff}")
    return differing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, help="the reference source tree (holds tracer/)")
    p.add_argument("--new", type=Path, default=Path("."), help="the tree under test (default: .)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=3, help="steps traced in each trace")
    p.add_argument("--keep", type=Path, help="a folder to keep both trees' traces in (base/, new/)")
    p.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    models, configs = args.models.split(","), args.configs.split(",")
    if args.dump:
        dump(args.dump, models, configs, args.steps)
        return 0
    if args.base is None:
        p.error("--base is required")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        outs = {"base": root / "base", "new": root / "new"}
        trees = {"base": args.base.resolve(), "new": args.new.resolve()}
        for out in outs.values():
            out.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(2) as pool:  # the two trees side by side, a process each
            done = dict(zip(outs, pool.map(lambda k: run_tree(trees[k], outs[k], args), outs)))
        for key, proc in done.items():
            if proc.returncode != 0:
                print(f"the {key} tree failed ({proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 2
        differing = compare(outs["base"], outs["new"], models, configs)
    print(f"{len(models) * len(configs) - differing} of {len(models) * len(configs)} traces the same")
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
