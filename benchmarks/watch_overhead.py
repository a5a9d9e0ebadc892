"""What ``tracer.watch`` costs per step: watched vs plain training steps, and the snapshots' memory.

The same steps (forward, backward, AdamW step, ``zero_grad``) run plain and under
``tracer.watch(model, opt)``, alternating within every repeat so machine drift falls on both
alike; the ratio of the median seconds per step is printed per snapshot placement, with the
memory the snapshots hold (and on CUDA the peak allocated memory of each variant). A watched
loop ends with ``watch.flush()`` (its last flags read) inside the timed region, as a plain CUDA
loop ends with a synchronisation. Nothing trips here: this is the price of being watched.

    python benchmarks/watch_overhead.py                                  # tiny12 GPT-2 on the CPU
    python benchmarks/watch_overhead.py --model llama-tiny --steps 20
    python benchmarks/watch_overhead.py --device cuda                    # gpt2-small, bf16 autocast
    python benchmarks/watch_overhead.py --device cuda --model llama --snapshots device host

Models are those of ``workloads.py`` (``gpt2-small`` and ``llama`` are the performance suite's).
Target on an H200: at most 1.03x per step with device snapshots.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workloads import MODELS, Workload, build

import tracer


def step_of(w: Workload) -> Callable[[], torch.Tensor]:
    """The issue's step: forward, backward, optimizer step, then ``zero_grad`` (so no gradient
    exists when the next step begins, and none is snapshotted)."""
    def step() -> torch.Tensor:
        loss = w.loss()
        loss.backward()
        w.opt.step()
        w.opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def timed(run: Callable[[], Any], n: int, device: torch.device, after: Callable[[], None] | None = None) -> float:
    """Seconds per step over ``n`` steps (``after`` runs inside the timed region)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    if after is not None:
        after()
    sync()
    return (time.perf_counter() - t0) / n


def peak(device: torch.device, run: Callable[[], Any]) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated(device))


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", choices=MODELS, help="default: tiny12 on the CPU, gpt2-small on CUDA")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--steps", type=int, help="steps per timed loop (default 30 on the CPU, 50 on CUDA)")
    p.add_argument("--repeats", type=int, default=5, help="alternating plain/watched loops (default 5)")
    p.add_argument("--snapshots", nargs="+", choices=("device", "host", "auto"),
                   help="placements to measure (default: device on the CPU; device and host on CUDA)")
    p.add_argument("--lag", type=int, help="steps before a flag is read (default: the watch's, 1 on CUDA, 0 on the CPU)")
    p.add_argument("--no-autocast", action="store_true", help="CUDA: fp32 instead of bf16 autocast")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: stable figures)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    name = args.model or ("gpt2-small" if device.type == "cuda" else "tiny12")
    autocast = torch.bfloat16 if device.type == "cuda" and not args.no_autocast else None
    w = build(name, device, args.batch, args.seq, autocast, foreach=True)
    steps = args.steps or (50 if device.type == "cuda" else 30)
    placements = args.snapshots or (["device", "host"] if device.type == "cuda" else ["device"])
    step = step_of(w)
    timed(step, 3, device)  # warm-up: allocator, kernels, the optimizer's state

    watched: dict[str, Callable[[], torch.Tensor]] = {}
    for placement in placements:
        watched[placement] = tracer.watch(w.model, w.opt, snapshots=placement, lag=args.lag, out=None)(step)
        timed(watched[placement], 3, device, watched[placement].watch.flush)  # type: ignore[attr-defined]

    times: dict[str, list[float]] = {"plain": [], **{k: [] for k in watched}}
    for _ in range(args.repeats):
        times["plain"].append(timed(step, steps, device))
        for k, fn in watched.items():
            times[k].append(timed(fn, steps, device, fn.watch.flush))  # type: ignore[attr-defined]
    peaks = {"plain": peak(device, lambda: timed(step, 3, device))}
    for k, fn in watched.items():
        peaks[k] = peak(device, lambda fn=fn: timed(fn, 3, device, fn.watch.flush))  # type: ignore[attr-defined]

    base = statistics.median(times["plain"])
    print(f"model {name} ({w.describe()}) on {device}{', bf16 autocast' if autocast else ''}, "
          f"{steps} steps x {args.repeats} repeats (medians)")
    print(f"{'variant':<26}{'ms/step':>10}{'ratio':>9}{'snapshots':>24}{'peak allocated':>18}")
    print(f"{'plain':<26}{base * 1e3:>10.3f}{1.0:>9.3f}{'-':>24}{mib(peaks['plain']):>18}")
    for k, fn in watched.items():
        wt = fn.watch  # type: ignore[attr-defined]
        med = statistics.median(times[k])
        snaps = f"{wt.snapshot_count} x {mib(wt.snapshot_bytes // max(wt.snapshot_count, 1))}"
        label = f"watched, {wt.placement}" + (f" (lag {wt.lag})" if wt.lag is not None else "")
        print(f"{label:<26}{med * 1e3:>10.3f}{med / base:>9.3f}{snaps:>24}{mib(peaks[k]):>18}")
        assert not wt.incidents, "a benchmark step tripped the watch"
        wt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
