"""The recorder's own cost: µs per recorded call and trace memory per call.

A chain of small element-wise ops (so the op itself costs little and the recorder shows), run
plain and traced in the same process; thread CPU time, median of several rounds. Memory: the
Python heap the trace holds after recording ``--calls`` calls (tracemalloc), per call, with its
tensor records and interned frames included.

    python benchmarks/recorder_micro.py                 # 2,000-call rounds, 100k calls for memory
    python benchmarks/recorder_micro.py --calls 20000
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc

import torch

import tracer


def chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x + 1
    return x


def cpu_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        gc.collect()
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=2000, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=100_000, help="calls recorded for the memory figure")
    args = p.parse_args(argv)
    x = torch.randn(4, 4)
    plain = cpu_seconds(lambda: chain(x, args.ops), args.rounds)
    print(f"torch {torch.__version__}; plain op {plain / args.ops * 1e6:.2f} µs")
    print("| configuration | µs per recorded call (median) |")
    print("|---|---:|")
    for label, kw in (("names + links (hash=none, stacks=False)", {"hash": "none", "stacks": False}),
                      ("+ stacks (hash=none)", {"hash": "none"}),
                      ("+ MD5 and stats (hash=md5)", {"hash": "md5"})):
        def traced(kw=kw) -> None:
            with tracer.trace(**kw):
                chain(x, args.ops)
        t = cpu_seconds(traced, args.rounds)
        print(f"| {label} | {(t - plain) / args.ops * 1e6:.1f} |")
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    with tracer.trace(hash="md5") as tr:
        chain(x, args.calls)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    n = len(tr.calls)
    print(f"\ntrace memory: {(after - before) / n:.0f} bytes per call over {n:,} calls "
          f"({len(tr.tensors):,} tensor records, {len(tr.frames)} interned frames, {len(tr.stacks)} stacks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
