"""What ``memory=True`` adds to a trace: the same training step traced with and without it.

The configurations take turns within every repeat (as in ``overhead.py``, whose workload this
reuses), so drift of the machine falls on all alike. The figure that matters is the ratio of each
``memory=True`` row to the same trace without it; the target is at most 1.10.

    python benchmarks/memory_overhead.py                          # tiny GPT-2 on the CPU
    python benchmarks/memory_overhead.py --device cuda --model gpt2-small
    python benchmarks/memory_overhead.py --md5                    # also the hashed trace, with and without
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import _quiet, build

import tracer
from tracer.analysis.memory import MemoryRecord


def time_step(w: object, make_ctx: Callable[[], contextlib.AbstractContextManager[object]]) -> float:
    device = w.device  # type: ignore[attr-defined]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gc.collect()
    sync()
    t0 = time.perf_counter()
    with make_ctx():
        w.step()  # type: ignore[attr-defined]
    sync()
    return (time.perf_counter() - t0) * 1000.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Overhead of memory=True on a traced training step.")
    p.add_argument("--model", choices=("tiny", "gpt2-small"), default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15 tiny, 7 gpt2-small)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--md5", action="store_true", help='also compare trace(hash="md5") with and without memory')
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device available")
    repeats = args.repeats or (15 if args.model == "tiny" else 7)
    device = torch.device(args.device)
    w = build(args.model, device, args.batch, args.seq)

    configs: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
        "plain": contextlib.nullcontext,
        'trace(hash="none")': lambda: tracer.trace(hash="none"),
        'trace(hash="none", memory=True)': lambda: tracer.trace(hash="none", memory=True),
    }
    if args.md5:
        configs['trace(hash="md5")'] = lambda: tracer.trace(hash="md5")
        configs['trace(hash="md5", memory=True)'] = lambda: tracer.trace(hash="md5", memory=True)
    times: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    with _quiet():
        for rnd in range(args.warmup + repeats):
            # Rotate the order every round and collect garbage outside the timed region: a
            # periodic slow step (the collector walking the previous traces) would otherwise
            # land on the same configuration every time.
            k = rnd % len(names)
            for name in names[k:] + names[:k]:
                ms = time_step(w, configs[name])
                if rnd >= args.warmup:
                    times[name].append(ms)

    with tracer.trace(hash="none", memory=True) as t:
        w.step()
    rec = MemoryRecord.from_trace(t)
    dev = rec.devices()[0] if rec.devices() else "-"
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"torch {torch.__version__}, python {platform.python_version()}, device {args.device} ({dev_name})")
    print(f"model {args.model}, batch {w.ids.shape[0]} x seq {w.ids.shape[1]}; step = zero_grad + forward + "
          f"backward + AdamW; {len(t.calls)} calls, {len(t.grad_nodes)} grad nodes per step")
    print(f"memory record of one step: {len(rec.allocs)} allocs, {len(rec.frees)} frees on {dev} "
          f"(source {rec.source(dev)}), {rec.attributed_fraction(dev):.1%} of allocated bytes attributed "
          f"({rec.attributed_fraction(dev, inside_only=True):.1%} while the owner ran); {rec.peak}")
    print(f"{args.warmup} warm-up rounds, median of {repeats} timed rounds (order rotated, gc before each)\n")
    med = {name: statistics.median(ms) for name, ms in times.items()}
    width = max(len(n) for n in configs)
    print(f"| {'configuration':<{width}} | median ms | vs plain | memory=True vs same trace |")
    print(f"|{'-' * (width + 2)}|----------:|---------:|--------------------------:|")
    for name, m in med.items():
        rel = ""
        if "memory=True" in name:
            base = name.replace(", memory=True", "")
            rel = f"{m / med[base]:.3f}"
        print(f"| {name:<{width}} | {m:9.2f} | {m / med['plain']:8.2f} | {rel:>25} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
