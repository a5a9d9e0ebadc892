"""Where the first traced step of a process spends the time a later traced step does not.

In a fresh process (run this script itself as that process): two plain steps (torch's own
first-call costs), then the first traced step and a later one, each under ``cProfile``; prints
the wall times and the functions whose cumulative time grew most in the first step. cProfile
slows both steps alike, so read the differences, not the totals; ``overhead.py --suite`` gives
the undisturbed first/later ratio.

    python benchmarks/first_step_profile.py --model resnet50 --device cuda --config fast
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import MODELS, build, time_step

import tracer

CONFIGS = {
    "fast": lambda: tracer.trace(hash="fast"),
    "check_numerics": lambda: tracer.check_numerics(),
    "stacks": lambda: tracer.trace(hash="none"),
    "md5": lambda: tracer.trace(hash="md5"),
}


def profiled_step(w, make) -> tuple[float, dict[tuple[str, int, str], tuple[float, float]]]:  # type: ignore[no-untyped-def]
    """Wall milliseconds of one step under cProfile and each function's cumulative and own seconds."""
    prof = cProfile.Profile()
    sync = torch.cuda.synchronize if w.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    prof.enable()
    with make():
        w.step()
    sync()
    prof.disable()
    ms = (time.perf_counter() - t0) * 1000.0
    stats = pstats.Stats(prof)
    # (cumulative, own) seconds of each function
    return ms, {key: (row[3], row[2]) for key, row in stats.stats.items()}  # type: ignore[attr-defined]


def _count_slow_paths(counts: collections.Counter[str]) -> None:
    """Wrap the hasher's per-tensor torch path and the batched kernels' uncached launches."""
    from tracer.record.checksums import fused, hasher

    torch_path = hasher.Hasher._submit_torch

    def counted_torch(self, rec, t, stats, fast):  # type: ignore[no-untyped-def]
        counts[f"torch path {t.dtype}"] += 1
        return torch_path(self, rec, t, stats, fast)

    run = fused.Fused._run

    def counted_run(self, key, kernel, grid, stream, args, constexprs, warm_key):  # type: ignore[no-untyped-def]
        n_plain = len(args) - len(constexprs)
        classes = tuple(fused._int_class(a) for a in args[:n_plain] if type(a) is int)
        if self._fast.get(key + classes) is None:
            counts[f"uncached launch {key} {classes} warm={fused.WARMUP.ready(warm_key)}"] += 1
        return run(self, key, kernel, grid, stream, args, constexprs, warm_key)

    hasher.Hasher._submit_torch = counted_torch  # type: ignore[method-assign]
    fused.Fused._run = counted_run  # type: ignore[method-assign]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="resnet50")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--config", choices=sorted(CONFIGS), default="fast")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--why", action="store_true",
                   help="count, per step, the tensors that took the per-tensor torch path (by dtype) and "
                        "the launches not through a cached launcher (by key; each trace fills its own "
                        "cache, from the warm-up's kernels where warm=True), and print the warm-up's times")
    args = p.parse_args()
    device = torch.device(args.device)
    w = build(args.model, device, None, None, torch.bfloat16 if device.type == "cuda" else None, foreach=True)
    make = CONFIGS[args.config]
    counts: collections.Counter[str] = collections.Counter()
    if args.why:
        _count_slow_paths(counts)
    for _ in range(2):
        time_step(w, contextlib.nullcontext)
    first_ms, first = profiled_step(w, make)
    first_counts = dict(counts)
    profiled_step(w, make)
    counts.clear()
    later_ms, later = profiled_step(w, make)
    if args.why:
        from tracer.record.checksums.fused import WARMUP

        print("warm-up, seconds from its start to each kernel set: "
              + ", ".join(f"{k[1]} stats={k[2]} fp={k[3]}: {v:.3f}" for k, v in WARMUP.seconds.items()))
        for label, c in (("first", first_counts), ("third", dict(counts))):
            print(f"{label} step: " + ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) if c else f"{label} step: none")
    print(f"{args.model} {args.config} under cProfile: first traced step {first_ms:.1f} ms, third {later_ms:.1f} ms")
    for what, col in (("cumulative", 0), ("own", 1)):
        grown = sorted(((first[k][col] - later.get(k, (0.0, 0.0))[col], k) for k in first), reverse=True)
        print(f"\nby {what} time\n{'grew ms':>9} {'first ms':>9}  function")
        for diff, key in grown[:args.top]:
            print(f"{diff * 1000:9.1f} {first[key][col] * 1000:9.1f}  {key[2]} ({Path(key[0]).name}:{key[1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
