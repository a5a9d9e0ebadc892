"""The recorder's own work counted in instructions, not time: a noise-free A/B on a shared host.

Under valgrind's callgrind (``--instr-atstart=no``) the instructions of one warmed plain step and
of one warmed traced step of a workload are counted (collection switched on and off around each
by ``callgrind_control``); the difference is the recorder's work, reported per recorded object
(calls + grad nodes + tensor values of that trace, the denominator of ``overhead.py``'s "µs of
recorder time per recorded object"). Counts do not depend on what else runs on the machine, so
two commits compare in one run each, where time on a loaded 2-core host moves by tens of per
cent. Instructions are not time (a cache miss costs more than an add): confirm a gain on the
clock (``overhead.py --clock process``) too.

    python benchmarks/recorder_instructions.py --model tiny12 --configs nostacks,stacks,fast
    python benchmarks/recorder_instructions.py --model resnet50-tiny --configs stacks,check_numerics

Needs valgrind (it re-runs itself under ``valgrind --tool=callgrind``); a tiny model takes a few
minutes (each counted step runs ~50x slower than natively).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS: dict[str, tuple[str, Callable[[], Any]]] = {}


def _configs() -> None:
    import tracer  # (imported under valgrind only: the outer process just launches it)

    CONFIGS.update({
        "nostacks": ('trace(hash="none", stacks=False)', lambda: tracer.trace(hash="none", stacks=False)),
        "stacks": ('trace(hash="none", stacks=True)', lambda: tracer.trace(hash="none")),
        "fast": ('trace(hash="fast")', lambda: tracer.trace(hash="fast")),
        "md5": ('trace(hash="md5")', lambda: tracer.trace(hash="md5")),
        "check_numerics": ("check_numerics()", lambda: tracer.check_numerics()),
    })
    # The hook points doing nothing (floor.py): the rows above less these is the recorder's own work.
    from floor import hook_point_rows  # a sibling script

    floor = hook_point_rows()
    CONFIGS.update({
        "floor-modules": ("floor: mode + module hooks", floor["mode+modules"]),
        "floor-walk": ("floor: + node walk", floor["+node walk"]),
    })


def _ctl(*args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)


def _counted(fn: Callable[[], Any], out: str) -> int:
    """Instructions of ``fn()``, from a dump of its own (the toggles' own cost included; the
    caller subtracts an empty region's)."""
    _ctl("-z")  # zero the counters
    _ctl("-i", "on")
    result = fn()
    _ctl("-i", "off")
    _ctl("-d", "counted")
    del result
    dumps = sorted(Path(out).parent.glob(Path(out).name + "*"), key=lambda p: p.stat().st_mtime)
    text = dumps[-1].read_text(errors="replace")
    m = re.search(r"^totals:\s+(\d+)", text, re.M)
    assert m is not None, f"no totals in {dumps[-1]}"
    return int(m.group(1))


def inner(args: argparse.Namespace) -> None:
    import torch
    from workloads import build

    _configs()
    torch.set_num_threads(1)
    w = build(args.model, torch.device("cpu"), None, None)
    for _ in range(2):
        w.step()
    empty = _counted(lambda: None, args.out)
    plain = min(_counted(w.step, args.out) for _ in range(args.repeats)) - empty
    print(f"model {args.model}: plain step {plain:,} instructions (empty region {empty:,} subtracted)")
    print("| configuration | instructions added per step | calls + grad nodes + tensor values | "
          "instructions per object |")
    print("|---|---:|---:|---:|")
    objects = 0
    for key in args.configs.split(","):
        label, make = CONFIGS[key]
        for _ in range(2):  # warm: first-call costs of the recorder and its kernels
            with make():
                w.step()
        traces: list[Any] = []

        def traced(make: Callable[[], Any] = make, traces: list[Any] = traces) -> None:
            with make() as t:
                w.step()
            traces.append(t)

        added = min(_counted(traced, args.out) for _ in range(args.repeats)) - empty - plain
        t = traces[-1]
        if t is None:  # a floor row records nothing: per object of the last trace row, if any
            per = f"{added / objects:,.0f}" if objects else "-"
            print(f"| {label} | {added:,} | (as above) | {per} |", flush=True)
            continue
        objects = len(t.calls) + len(t.grad_nodes) + len(t.tensors)
        print(f"| {label} | {added:,} | {len(t.calls)} + {len(t.grad_nodes)} + {len(t.tensors)} = {objects} | "
              f"{added / objects:,.0f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny12")
    p.add_argument("--configs", default="nostacks,stacks,fast")
    p.add_argument("--repeats", type=int, default=1, help="counted steps per row (the least is kept)")
    p.add_argument("--keep", help="a folder to keep callgrind's dumps in (for callgrind_annotate)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        inner(args)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("needs valgrind (callgrind)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
        out = os.path.join(args.keep or tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
               sys.executable, os.path.abspath(__file__), "--inner", "--out", out, "--model", args.model,
               "--configs", args.configs, "--repeats", str(args.repeats)]
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        with contextlib.suppress(KeyboardInterrupt):
            done = subprocess.run(cmd, env=env, stderr=subprocess.DEVNULL)
        return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
