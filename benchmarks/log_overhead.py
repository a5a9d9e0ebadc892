"""What a log scope costs per forward call: disabled (nothing logs) and enabled, against plain code.

A disabled scope (its levels log nothing: ``log_scope(level="WARNING")``, or a component dict
that leaves forward and backward off) only saves and restores logger levels on entry and exit;
it installs no recorder, no listener and no hook, so the calls inside it run exactly as plain
code. The enabled rows show what logging costs when it is on (a light recorder, and one line
per call formatted and handed to a handler that drops it).

    python benchmarks/log_overhead.py                    # 2000 small ops, 15 rounds
    python benchmarks/log_overhead.py --ops 5000 --repeats 30

Every configuration runs the same loop of small CPU ops; configurations take turns within each
round so drift of the machine falls on all alike. ``µs/call`` is (median - plain median) / ops.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

import tracer
from tracer.features.logs import ConsoleHandler, log_scope


class _Drop(logging.Handler):
    """Formats each record like a handler would, then drops it (no terminal I/O in the timing)."""

    def emit(self, record: logging.LogRecord) -> None:
        record.getMessage()


def workload(ops: int) -> Callable[[], None]:
    x0 = torch.randn(8, 8, requires_grad=True)

    def run() -> None:
        x = x0
        for _ in range(ops):
            x = x * 1.0001
        x.sum().backward()
        x0.grad = None

    return run


def configurations() -> dict[str, Callable[[], contextlib.AbstractContextManager[object]]]:
    return {
        "plain": contextlib.nullcontext,
        'log_scope(level="WARNING")  (disabled)': lambda: log_scope(level="WARNING"),
        'log_scope({"forward": "ERROR", "backward": "ERROR"})  (disabled)':
            lambda: log_scope(level={"forward": "ERROR", "backward": "ERROR"}),
        'log_scope(level="INFO")  (enabled, names)': lambda: log_scope(level="INFO"),
        'log_scope(level="DEBUG")  (enabled, shapes)': lambda: log_scope(level="DEBUG"),
        'trace(hash="none", stacks=False)': lambda: tracer.trace(hash="none", stacks=False),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Per-call cost of tracer.log_scope, disabled and enabled.")
    p.add_argument("--ops", type=int, default=2000, help="forward calls per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    root = logging.getLogger("gradtrace")
    saved = list(root.handlers)
    root.handlers[:] = [h for h in saved if not isinstance(h, ConsoleHandler)] + [_Drop()]
    run = workload(args.ops)
    configs = configurations()
    times: dict[str, list[float]] = {name: [] for name in configs}
    try:
        for rnd in range(args.warmup + args.repeats):
            for name, make in configs.items():
                t0 = time.perf_counter()
                with make():
                    run()
                ms = (time.perf_counter() - t0) * 1000.0
                if rnd >= args.warmup:
                    times[name].append(ms)
    finally:
        root.handlers[:] = saved

    print(f"torch {torch.__version__}, python {platform.python_version()}, 1 CPU thread; "
          f"{args.ops} forward calls (x * c on 8x8) + backward per round, median of {args.repeats}\n")
    base = statistics.median(times["plain"])
    width = max(len(n) for n in configs)
    print(f"| {'configuration':<{width}} | median ms | ratio | µs/call |")
    print(f"|{'-' * (width + 2)}|----------:|------:|--------:|")
    for name, ms in times.items():
        med = statistics.median(ms)
        per_call = "" if name == "plain" else f"{(med - base) * 1000.0 / args.ops:+.2f}"
        print(f"| {name:<{width}} | {med:9.2f} | {med / base:5.2f} | {per_call:>7} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
