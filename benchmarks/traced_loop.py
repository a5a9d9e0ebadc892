"""Traced steps in a loop, for a sampling profiler outside the process, and the summary of what
it sampled: where a step's host time goes, with nothing in the recorder instrumented (cProfile
slows every Python call, and the recorder is made of small ones).

    py-spy record -r 250 -f raw -o stacks.raw -- python benchmarks/traced_loop.py --model resnet50 --device cuda --config stacks --steps 25
    python benchmarks/traced_loop.py --summarize stacks.raw

The summary counts the samples of threads inside the step (``Workload.step``) or the trace's end:
each function's inclusive share, then the source lines that were running (self). A CUDA
backward's grad-node hooks run on the autograd engine's device thread, outside these shares.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def summarize(raw: str, top: int) -> None:
    """Print the inclusive and self shares of py-spy's raw output (``-f raw``)."""
    total = 0
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for line in Path(raw).read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or ("Workload.step" not in stack and "__exit__" not in stack):
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        for name in {f.split(" (")[0] for f in frames}:
            inclusive[name] += n
        leaf = frames[-1]
        own[leaf.split(" (")[0] + " " + leaf.rsplit("/", 1)[-1].rstrip(")")] += n
    print(f"samples inside the step: {total}")
    for name, n in inclusive.most_common(top):
        print(f"{100 * n / max(total, 1):6.1f}%  {name}")
    print("--- self: the line running")
    for name, n in own.most_common(top // 2):
        print(f"{100 * n / max(total, 1):6.2f}%  {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50-tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--config", choices=("plain", "stacks", "fast", "check_numerics"), default="stacks")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--summarize", metavar="RAW", help="summarize py-spy's raw output instead")
    p.add_argument("--top", type=int, default=60)
    a = p.parse_args()
    if a.summarize:
        summarize(a.summarize, a.top)
        return
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workloads import build  # a sibling script, not a package

    import tracer

    device = torch.device(a.device)
    w = build(a.model, device, None, None, torch.bfloat16 if device.type == "cuda" else None)
    makes: dict[str, Callable[[], Any]] = {
        "plain": contextlib.nullcontext, "stacks": lambda: tracer.trace(hash="none"),
        "fast": lambda: tracer.trace(hash="fast"), "check_numerics": tracer.check_numerics}
    make = makes[a.config]
    for _ in range(4):
        with make():
            w.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    gc.collect()
    gc.disable()  # (the step's own time: collections are measured apart)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        with make():
            w.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"{a.model} {a.config}: {(time.perf_counter() - t0) / a.steps * 1e3:.1f} ms a step")


if __name__ == "__main__":
    main()
