"""What the step log costs per step: logged vs plain training steps, and the log's size per step.

The same steps (forward, backward, AdamW step, ``zero_grad``) run plain and under a step log
(``tracer.step_log``: no watch, no snapshot), in one process, the two alternating within every
repeat so machine drift falls on both alike; the ratio of the median seconds per step is printed
per model with the bytes the log grows by per step and the log's host time per step (``log host
ms``: the time spent in the log's own hooks, module hooks included, over the timed steps; see
``steplog_host.py`` for its parts, measured on the CPU). Each logged round opens a fresh log, runs one
untimed step (the log names the parameters at its first step), then the timed steps and
``log.flush()`` (its pending steps written: a CUDA loop ends with a synchronisation) inside the
timed region; closing the log is not timed.

    python benchmarks/steplog_overhead.py                                 # tiny12 and llama-tiny on the CPU
    python benchmarks/steplog_overhead.py --device cuda                   # gpt2-small and llama, bf16 autocast
    python benchmarks/steplog_overhead.py --device cuda --models gpt2-small --steps 100

Models are those of ``workloads.py``. Target on an H100/H200: at most 1.02x per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from steplog_host import clocked_log, step_of
from workloads import MODELS, Workload, build


def timed(run: Callable[[], None], n: int, device: torch.device, after: Callable[[], None] | None = None) -> float:
    """Seconds per step over ``n`` steps (``after`` runs inside the timed region): wall time on
    CUDA, this process's CPU time on the CPU (on a small shared host another process's work then
    does not count; a CPU step waits for nothing else)."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    if cuda:
        torch.cuda.synchronize()
    t0 = clock()
    for _ in range(n):
        run()
    if after is not None:
        after()
    if cuda:
        torch.cuda.synchronize()
    return (clock() - t0) / n


def logged_round(step: Callable[[], None], w: Workload, n: int, device: torch.device,
                 path: str) -> tuple[float, int, float]:
    """Seconds per logged step, the bytes the log grew by per timed step, and the seconds of
    host time per step spent in the log's hooks (wall time on CUDA, this thread's CPU time on
    the CPU; the final ``flush``, which waits for the device, is not in it)."""
    log, clocked = clocked_log(path, w, time.perf_counter if device.type == "cuda" else time.thread_time)
    try:
        step()  # the first step names the parameters (once per log)
        log.flush()
        clocked.take()
        start = os.path.getsize(path)
        seconds = timed(step, n, device, log.flush)
        host = clocked.take() / n
        grown = os.path.getsize(path) - start
    finally:
        log.close()
    return seconds, grown // n, host


def measure(name: str, device: torch.device, args: argparse.Namespace,
            folder: str) -> tuple[str, float, float, int, float]:
    autocast = torch.bfloat16 if device.type == "cuda" and not args.no_autocast else None
    w = build(name, device, args.batch, args.seq, autocast, foreach=True)
    steps = args.steps or (50 if device.type == "cuda" else 30)
    step = step_of(w)
    path = os.path.join(folder, f"{name}.gtsteps")
    timed(step, 3, device)  # warm-up: allocator, kernels, the optimizer's state
    logged_round(step, w, 3, device, path)  # and the log's kernels (Triton compiles them once)
    plain: list[float] = []
    logged: list[float] = []
    host: list[float] = []
    per_step = 0
    for _ in range(args.repeats):
        plain.append(timed(step, steps, device))
        seconds, per_step, host_seconds = logged_round(step, w, steps, device, path)
        logged.append(seconds)
        host.append(host_seconds)
    described = f"{name} ({w.describe()}{', bf16 autocast' if autocast else ''})"
    return described, statistics.median(plain), statistics.median(logged), per_step, statistics.median(host)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", nargs="+", choices=MODELS,
                   help="default: tiny12 and llama-tiny on the CPU, gpt2-small and llama on CUDA")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--steps", type=int, help="steps per timed loop (default 30 on the CPU, 50 on CUDA)")
    p.add_argument("--repeats", type=int, default=5, help="alternating plain/logged loops (default 5)")
    p.add_argument("--no-autocast", action="store_true", help="CUDA: fp32 instead of bf16 autocast")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: stable figures)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    models = args.models or (["gpt2-small", "llama"] if device.type == "cuda" else ["tiny12", "llama-tiny"])
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in models:
            rows.append(measure(name, device, args, folder))
    print(f"step log on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{args.repeats} alternating repeats (medians)")
    print(f"{'model':<48}{'plain ms':>10}{'logged ms':>11}{'ratio':>8}{'log/step':>11}{'log host ms':>13}")
    for described, plain, logged, per_step, host in rows:
        print(f"{described:<48}{plain * 1e3:>10.3f}{logged * 1e3:>11.3f}{logged / plain:>8.3f}"
              f"{per_step / 1000:>9.1f} kB{host * 1e3:>13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
