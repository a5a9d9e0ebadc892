"""What streaming a trace costs per flush window: the same 1,200-call forward recorded with no
file, and streamed with ``flush_every`` 1024 / 256 / 64 (plain and gzip). Prints the median
microseconds per call of 5 runs and the cost relative to not streaming (one torch thread).

    python benchmarks/flush_window.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

import tracer


def workload() -> None:
    h = torch.randn(64, 64)
    for _ in range(400):  # 3 recorded calls per step
        h = torch.tanh(h * 0.5 + 0.1)


def timed(**options: object) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        with tracer.trace(hash="md5", **options):  # type: ignore[arg-type]
            workload()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / 1200 * 1e6


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        base = timed()
        print(f"no file: {base:.1f} us/call")
        for ext in (".gtrace", ".gtrace.gz"):
            for every in (1024, 256, 64):
                s = timed(out=os.path.join(d, f"x{ext}"), flush_every=every)
                print(f"{ext:10} flush_every={every:5}: {s:.1f} us/call ({(s / base - 1) * 100:+.1f}% vs no file)")


if __name__ == "__main__":
    main()
