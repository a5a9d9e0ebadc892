"""What each lever of the recorder saves on a training step, measured in one process.

A traced step with every lever on, then the same step with each lever off in turn, and the plain
step, take turns round after round (the order rotated every round). Comparing two trees in two
processes (``ab_trees.sh``) mixes in the spread between processes, which on a shared GPU host
was larger than a lever's effect (ResNet-50 under ``fast`` moved 142-183 ms between processes
on one H100 host in one session, while one lever's in-process effect was 3 ms). Here every
variant runs in the same process, on the same warm caches and allocator, and a lever's cost is
the median of its per-round paired differences (off minus on), with their interquartile range.

    python benchmarks/lever_ab.py --device cuda --model llama --config fast
    python benchmarks/lever_ab.py --device cuda --model resnet50 --config check_numerics --rounds 16

The levers are public switches of the recorder (on by default; they act on the batched CUDA
path, so on the CPU only under ``--interpret``, Triton's interpreter, for a smoke run):

- ``read_now``: a call's long list of device tensors (an optimizer step's) is read through one
  launch plan kept across traces (``tracer.record.checksums.hasher.LIST_MIN``; off: out of reach).
- ``dense_stats``: stats alone read a non-contiguous tensor that fills a span of memory where it
  lies (``tracer.record.checksums.fused.READ_DENSE_IN_PLACE``; off: packed like any other).
- ``grad_aliases``: a gradient a leaf's accumulator takes next stays in its batch through an
  alias of its storage (``tracer.record.checksums.fused.ALIAS_INTO_GRAD``; off: copied out).
- ``state_ahead``: a root module's parameters and buffers are read through one plan when it
  is first called, so no in-place write of them (a batch norm's running statistics, the
  optimizer step) finds them waiting (``tracer.record.tensor_names.READ_STATE_AHEAD``; off: each
  queued when a call first uses it).
- ``late_gc``: the user's gc thresholds come back after the end of a block has filled in its
  records' results, not before (``tracer.record.session.RESTORE_GC_AFTER_END``; off: a young
  collection every few hundred results).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


@dataclass(frozen=True)
class Lever:
    """A module attribute and the value that turns the lever off."""

    module: str
    attribute: str
    off: Any
    what: str


LEVERS: dict[str, Lever] = {
    "read_now": Lever("tracer.record.checksums.hasher", "LIST_MIN", sys.maxsize,
                      "an optimizer step's lists read through one kept plan"),
    "dense_stats": Lever("tracer.record.checksums.fused", "READ_DENSE_IN_PLACE", False,
                         "stats alone read transposed and permuted values in place"),
    "grad_aliases": Lever("tracer.record.checksums.fused", "ALIAS_INTO_GRAD", False,
                          "a gradient an accumulator takes is held by a storage alias, not copied"),
    "state_ahead": Lever("tracer.record.tensor_names", "READ_STATE_AHEAD", False,
                         "a model's parameters and buffers read in one go when it is first called"),
    "late_gc": Lever("tracer.record.session", "RESTORE_GC_AFTER_END", False,
                     "the user's gc thresholds come back after the end's results are filled in"),
}


@contextlib.contextmanager
def lever_off(lever: Lever) -> Iterator[None]:
    """Within: ``lever`` is off; its value is put back however the block ends."""
    import importlib

    module = importlib.import_module(lever.module)
    saved = getattr(module, lever.attribute)
    setattr(module, lever.attribute, lever.off)
    try:
        yield
    finally:
        setattr(module, lever.attribute, saved)


def run_rounds(variants: dict[str, Callable[[], float]], rounds: int,
               settle: int = 0) -> dict[str, list[float]]:
    """Each variant's timings: one timed call per round each, the order rotated every round,
    garbage collected before each call (outside what the call times). ``settle``: untimed calls
    of the same variant just before its timed one, so that no timing carries over what the
    previous variant left (a step right after another variant's finds the allocator's cache
    and the recorder's kept plans as that variant left them: on one H100 host, Llama-style
    ``fast`` took 235 ms unsettled and 184 ms settled, and two unsettled runs gave the levers
    opposite signs)."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(settle):
                gc.collect()
                variants[name]()
            gc.collect()
            times[name].append(variants[name]())
    return times


def paired_summary(on: list[float], off: list[float]) -> tuple[float, float, float]:
    """The median of the per-round differences ``off - on`` and their first and third quartiles
    (the rounds' own drift cancels in each pair)."""
    diffs = sorted(b - a for a, b in zip(on, off))
    if len(diffs) < 2:
        return diffs[0], diffs[0], diffs[0]
    q1, _, q3 = statistics.quantiles(diffs, n=4, method="inclusive")
    return statistics.median(diffs), q1, q3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--config", choices=("fast", "check_numerics"), default="fast")
    p.add_argument("--levers", default=",".join(LEVERS), help=f"comma-separated, from {', '.join(LEVERS)}")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (after --warmup untimed ones)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--settle", type=int, default=1,
                   help="untimed steps of a variant just before each of its timed ones")
    p.add_argument("--interpret", action="store_true",
                   help="CPU smoke run: the batched path under Triton's interpreter (slow; tiny models)")
    a = p.parse_args()
    if a.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported
        os.environ["GRADTRACE_FUSED_INTERPRET"] = "1"
    import torch
    from workloads import build, time_step

    import tracer

    levers = [name.strip() for name in a.levers.split(",") if name.strip()]
    unknown = [name for name in levers if name not in LEVERS]
    if unknown:
        p.error(f"unknown lever(s) {', '.join(unknown)}; known: {', '.join(LEVERS)}")
    device = torch.device(a.device)
    w = build(a.model, device, None, None, torch.bfloat16 if device.type == "cuda" else None)
    make = (lambda: tracer.trace(hash="fast")) if a.config == "fast" else tracer.check_numerics

    def timed(ctx: Callable[[], Any], off: Lever | None = None) -> Callable[[], float]:
        def step() -> float:
            with lever_off(off) if off is not None else contextlib.nullcontext():
                return time_step(w, ctx)[0]
        return step

    variants = {"plain": timed(contextlib.nullcontext), "all on": timed(make)}
    variants.update({f"{name} off": timed(make, LEVERS[name]) for name in levers})
    run_rounds(variants, a.warmup)
    times = run_rounds(variants, a.rounds, a.settle)
    plain = statistics.median(times["plain"])
    print(f"{a.model} on {device.type}, {a.config}: {a.rounds} rounds, the order rotated every round, "
          f"{a.settle} untimed step(s) of a variant before each timed one")
    print("| variant | median ms | ratio to plain |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {statistics.median(ts) / plain:.2f} |")
    print()
    print("| lever | saves ms a step (median of paired differences) | interquartile range | what |")
    print("|---|---:|---:|---|")
    for name in levers:
        mid, q1, q3 = paired_summary(times["all on"], times[f"{name} off"])
        print(f"| {name} | {mid:+.2f} | {q1:+.2f} to {q3:+.2f} | {LEVERS[name].what} |")


if __name__ == "__main__":
    main()
