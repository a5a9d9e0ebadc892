"""Where a traced step's CPU time goes: forward, backward, optimizer step and the trace's exit.

Each phase is timed on the host without synchronising inside the step (the GPU is drained only
before the step starts and after it ends), so the columns are the CPU time the step's own code
took to issue its work, with and without the recorder. On a GPU the plain step's CPU time is
well below its GPU time; the difference is the CPU time a tool may add before the step slows
down.

    python benchmarks/phases.py                                   # tiny12 on the CPU
    python benchmarks/phases.py --device cuda --model gpt2-small  # bf16 autocast on CUDA
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import tracer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import default_workload  # a sibling script, not a package

CONFIGS: dict[str, Callable[[], Any]] = {
    "plain": contextlib.nullcontext,
    "nostacks": lambda: tracer.trace(hash="none", stacks=False),
    "stacks": lambda: tracer.trace(hash="none"),
    "stacks-ops": lambda: tracer.trace(hash="none", optimizer_ops=True),
    "fast": lambda: tracer.trace(hash="fast"),
    "check_numerics": lambda: tracer.check_numerics(),
    "anomaly": lambda: torch.autograd.detect_anomaly(check_nan=True),
}
PHASES = ("forward", "backward", "optimizer", "exit", "drain")


def one_step(w: Any, make: Callable[[], Any], sync: Callable[[], None]) -> list[float]:
    w.opt.zero_grad(set_to_none=True)
    sync()
    ctx = make()
    ctx.__enter__()
    t0 = time.perf_counter()
    loss = w.loss()  # the forward, under the workload's autocast
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    w.opt.step()
    t3 = time.perf_counter()
    ctx.__exit__(None, None, None)
    t4 = time.perf_counter()
    sync()  # what the GPU still had to do once the CPU was done
    t5 = time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None,
                   help="tiny12 on the CPU, gpt2-small on CUDA by default (any model of overhead.py --model)")
    p.add_argument("--configs", default="plain,nostacks,stacks,stacks-ops,fast")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    model, w = default_workload(args.device, args.model)
    device = w.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    for n in names:  # warm-up: kernels compiled, caches filled
        for _ in range(2):
            one_step(w, CONFIGS[n], sync)
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    for _ in range(args.repeats):  # configurations take turns, so drift falls on all alike
        for n in names:
            times[n].append(one_step(w, CONFIGS[n], sync))
    print(f"torch {torch.__version__}, device {device}, model {model}, median of {args.repeats} (ms)")
    print("| configuration | " + " | ".join(PHASES) + " | CPU total |")
    print("|---|" + "---:|" * (len(PHASES) + 1))
    for n in names:
        med = [statistics.median(r[i] for r in times[n]) * 1e3 for i in range(len(PHASES))]
        print(f"| {n} | " + " | ".join(f"{m:.1f}" for m in med) + f" | {sum(med[:4]):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
