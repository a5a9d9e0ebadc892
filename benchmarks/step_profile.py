"""Where a warmed traced step spends its host time: ``cProfile`` of a few traced steps after the
kernels and caches are warm, sorted by each function's own time.

cProfile adds its own cost to every Python call (so Python-heavy code looks heavier than it is):
read the ranking and the call counts, and take the undisturbed ratios from ``overhead.py``.

    python benchmarks/step_profile.py --model resnet50 --device cuda --config check_numerics
    python benchmarks/step_profile.py --model tiny12 --device cpu --config stacks
    python benchmarks/step_profile.py --model resnet50-tiny --sort cumtime --only tracer/
    python benchmarks/step_profile.py --model resnet50-tiny --callers "method 'get' of 'dict'"
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import MODELS, build  # a sibling script, not a package

import tracer

CONFIGS: dict[str, Callable[[], Any]] = {
    "plain": contextlib.nullcontext,
    "stacks": lambda: tracer.trace(hash="none"),
    "fast": lambda: tracer.trace(hash="fast"),
    "check_numerics": lambda: tracer.check_numerics(),
    "anomaly": lambda: torch.autograd.detect_anomaly(check_nan=True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="tiny12")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--config", choices=sorted(CONFIGS), default="stacks")
    p.add_argument("--steps", type=int, default=3, help="profiled traced steps")
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--sort", default="tottime", help="pstats key: tottime, cumtime, ncalls")
    p.add_argument("--only", default="", help="a regular expression the listed functions match (e.g. tracer/)")
    p.add_argument("--callers", default="", help="print who calls the functions matching this expression instead")
    a = p.parse_args()
    device = torch.device(a.device)
    w = build(a.model, device, None, None)
    make = CONFIGS[a.config]
    for _ in range(2):
        w.step()
    for _ in range(2):
        with make():
            w.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        with make():
            w.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    prof.disable()
    print(f"{a.model} on {a.device}, {a.config}: {a.steps} traced steps under cProfile")
    stats = pstats.Stats(prof).sort_stats(a.sort)
    if a.callers:
        stats.print_callers(a.callers)
    else:
        stats.print_stats(*([a.only] if a.only else []), a.top)


if __name__ == "__main__":
    main()
