"""Where a traced step's host time goes, by part, measured on the step itself (one process).

Two tables for one workload:

1. **Variants**, taking turns round after round (``lever_ab.run_rounds``: the order rotated,
   garbage collected before each step, each timed step right after an untimed one of the same
   variant). Beside ``plain``, ``stacks`` (names, links, stacks), ``fast`` and ``check_numerics``
   run with ``node_runs`` and with the grad nodes' work cut to the bone: ``... capture-only``
   replaces the run of every grad node without a pre-hook (all but accumulators and the nodes
   user hooks need: ``Graph.node_done``) by appending its arguments to a list. The difference
   between a config and its capture-only row is what the per-node work (naming the gradients,
   checksumming them, letting go of what autograd takes next) costs on top of the hooks
   themselves: the most a redesign that only captures per node could save. The records of a
   capture-only step are incomplete; only its time is used.
2. **Per function**: calls a step, milliseconds a step and microseconds a call of the recorder's
   main entry points, each wrapped with ``perf_counter_ns`` (nested ones count in both: read the
   rows as inclusive times). The wrapper adds ~0.3 us a call. Unlike ``step_profile.py``
   (cProfile), it does not slow every Python call, and it charges no time spent in the
   collector or in a C call's wait to the wrong function.

    python benchmarks/host_split.py --device cuda --model llama --config fast
    python benchmarks/host_split.py --model llama-tiny --rounds 4     # CPU
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (module, attribute path) of each function the per-function table times.
TIMED: tuple[tuple[str, str], ...] = (
    ("tracer.record.recorder", "Recorder.record_captured"),
    ("tracer.record.autograd", "Graph.link_call_nodes"),
    ("tracer.record.tensor_names", "TensorNames.new_tensor"),
    ("tracer.record.autograd", "Graph.node_done"),
    ("tracer.record.autograd", "Graph.node_begin"),
    ("tracer.record.autograd", "Graph.node_end"),
    ("tracer.record.autograd", "Graph._grad_names"),
    ("tracer.record.autograd", "Graph.let_go_after"),
    ("tracer.record.checksums.hasher", "Hasher.submit"),
    ("tracer.record.checksums.hasher", "Hasher.submit_many"),
    ("tracer.record.checksums.hasher", "Hasher.let_go"),
    ("tracer.record.checksums.hasher", "Hasher.before_write"),
    ("tracer.record.checksums.fused", "Fused.add"),
    ("tracer.record.checksums.fused", "Fused.protect"),
    ("tracer.record.checksums.fused", "Fused._launch"),
)


@contextlib.contextmanager
def timed_functions(targets: tuple[tuple[str, str], ...] = TIMED
                    ) -> Iterator[tuple[collections.Counter[str], collections.Counter[str]]]:
    """Within: each target wrapped to add its inclusive nanoseconds and its calls to the two
    counters yielded (keyed ``Class.method``); every original is put back however the block ends."""
    ns: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    undo: list[tuple[Any, str, Any]] = []

    def wrap(real: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return real(*args, **kwargs)
            finally:
                ns[label] += time.perf_counter_ns() - t0
                calls[label] += 1
        return timed

    try:
        for module_name, path in targets:
            owner: Any = importlib.import_module(module_name)
            *outer, attribute = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            real = owner.__dict__[attribute]  # (a staticmethod stays one: wrap what it holds)
            undo.append((owner, attribute, real))
            inner = real.__func__ if isinstance(real, staticmethod) else real
            wrapped = wrap(inner, path)
            setattr(owner, attribute, staticmethod(wrapped) if isinstance(real, staticmethod) else wrapped)
        yield ns, calls
    finally:
        for owner, attribute, real in reversed(undo):
            setattr(owner, attribute, real)


@contextlib.contextmanager
def capture_only_nodes() -> Iterator[list[tuple[Any, ...]]]:
    """Within: a grad node without a pre-hook only appends its arguments to the list yielded
    (``Graph.node_done``), which is cleared as each step ends; put back however the block ends."""
    from tracer.record.autograd import Graph

    captured: list[tuple[Any, ...]] = []
    real = Graph.node_done

    def capture(self: Any, node: str, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        captured.append((node, grad_inputs, grad_outputs))

    Graph.node_done = capture  # type: ignore[method-assign]
    try:
        yield captured
    finally:
        Graph.node_done = real  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--config", choices=("stacks", "fast", "check_numerics"), default="fast",
                   help="the configuration of the per-function table")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="steps of the per-function table")
    a = p.parse_args()
    import torch
    from lever_ab import run_rounds
    from workloads import build, time_step

    import tracer

    device = torch.device(a.device)
    w = build(a.model, device, None, None, torch.bfloat16 if device.type == "cuda" else None)
    configs: dict[str, Callable[[], Any]] = {
        "stacks": lambda: tracer.trace(hash="none", node_runs=True),
        "fast": lambda: tracer.trace(hash="fast"),
        "check_numerics": tracer.check_numerics,
    }

    def timed(make: Callable[[], Any], capture: bool) -> Callable[[], float]:
        def step() -> float:
            with capture_only_nodes() if capture else contextlib.nullcontext():
                return time_step(w, make)[0]
        return step

    variants = {"plain": timed(contextlib.nullcontext, False),
                "stacks (no node_runs)": timed(lambda: tracer.trace(hash="none"), False)}
    for name, make in configs.items():
        variants[name] = timed(make, False)
        variants[f"{name} capture-only"] = timed(make, True)
    run_rounds(variants, 1)  # warm-up
    times = run_rounds(variants, a.rounds, settle=1)
    plain = statistics.median(times["plain"])
    print(f"{a.model} on {device.type}: {a.rounds} rounds (stacks with node_runs unless said)")
    print("| variant | median ms | ratio to plain | range ms |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.1f} | {statistics.median(ts) / plain:.2f} "
              f"| {min(ts):.1f}-{max(ts):.1f} |")
    make = configs[a.config]
    for _ in range(2):
        with make():
            w.step()
    with timed_functions() as (ns, calls):
        for _ in range(a.steps):
            gc.collect()
            time_step(w, make)
    print()
    print(f"{a.config}, {a.steps} steps: inclusive host time a step by function")
    print("| function | calls a step | ms a step | us a call |")
    print("|---|---:|---:|---:|")
    for label in sorted(ns, key=lambda k: -ns[k]):
        print(f"| {label} | {calls[label] / a.steps:.0f} | {ns[label] / a.steps / 1e6:.2f} "
              f"| {ns[label] / calls[label] / 1e3:.1f} |")


if __name__ == "__main__":
    main()
