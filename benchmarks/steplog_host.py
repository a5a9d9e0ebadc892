"""The step log's host (CPU) time per optimizer step on its CUDA path, measured on the CPU.

On a GPU the step log is bound by its Python: the fingerprints and norms are two Triton kernels
per dtype read back a step later, so what a step costs is the host work around them. Here that
work runs as on CUDA, on CPU tensors: the log's ``Digester`` takes its device path
(``GRADTRACE_FUSED_INTERPRET=1``) with the two kernels *not run* (their result rows zeroed
instead: the numbers are wrong, the host work the same), so nothing but the log's Python and its
small torch ops is timed. Left out: what a CUDA launch adds on the host (Triton's launcher, a
pinned copy and an event: a few µs each, counted in launches per step).

Per model, medians over ``--steps`` logged steps after two warm ones, in this thread's CPU time
(one torch thread: the step's work is all on it; another process's on a shared host is not):

- ``tensors``: parameters + gradients fingerprinted per step; ``calls``: module calls per step;
- ``optimizer``: µs in the log's optimizer step hooks (the reading's launches, the previous
  step's record completed and written);
- ``others``: µs in its other hooks (the loss at each backward's end, the random states at the
  first forward, the batch's fingerprints);
- ``modules``: µs the log's module hooks add to one forward once the log has named the
  parameters (no_grad forwards with and without them, alternating; ``Module.__call__``'s slow
  path included). A full-size model's forward is too long for a difference of microseconds to
  show on a shared host: its tiny-width twin (``TWINS``: the same module calls) is timed instead;
- ``total``: the three together: the log's host time per step.

    python benchmarks/steplog_host.py                          # tiny12, llama-tiny, llama
    python benchmarks/steplog_host.py --models llama-tiny --steps 50 --profile

``--profile`` prints the top functions (cProfile, cumulative) of the log's hooks (not the module
hooks: profiling every module call would drown the rest).
Models are those of ``workloads.py``, built on the CPU (``llama``: ~125M parameters, ~2 GB).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workloads import MODELS, Workload, build

from tracer.features.steplog import StepLog
from tracer.features.steplog.inputs import ForwardInputs
from tracer.record.checksums.fused import Fused

OPTIMIZER_HOOKS = ("_on_optimizer_step", "_after_optimizer_step")
TWINS = {"gpt2-small": "tiny12", "llama": "llama-tiny", "resnet50": "resnet50-tiny", "vit": "vit-tiny",
         "bert": "bert-tiny"}
OTHER_HOOKS = ("_on_backward", "_on_first_forward", "_on_batch")
MODULE_HOOKS = ("_outer", "_inner_pre", "_inner_post")


def no_kernels() -> None:
    """The kernels are not run; the rows they would write are zeroed (the host work around them
    is the same; the numbers are not read by anyone here)."""

    def run(self: Fused, key: tuple[Any, ...], kernel: Any, grid: int, stream: int, args: tuple[Any, ...],
            constexprs: tuple[str, ...], warm_key: Any) -> None:
        if key[0] == "finalize":
            args[3].zero_()
            args[4].zero_()

    Fused._run = run  # type: ignore[method-assign]


class Clocked:
    """Time spent in some methods of a step log (or of its module hooks), counted once where one
    calls another (the first-forward hook runs inside a module hook); under ``profile``, those
    calls alone are profiled. ``clock``: this thread's CPU time here; ``steplog_overhead.py``
    takes wall time on CUDA (a sync spins on the CPU)."""

    def __init__(self, profile: cProfile.Profile | None = None, clock: Callable[[], float] = time.thread_time) -> None:
        self.spent = 0.0
        self.profile = profile
        self.clock = clock
        self._inside = 0

    def wrap(self, owner: Any, names: tuple[str, ...]) -> None:
        """Time ``owner``'s methods ``names`` from now on (where they are looked up from now on:
        a hook registered before keeps the plain method)."""
        for name in names:
            setattr(owner, name, self._wrap(getattr(owner, name)))

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def clocked(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return method(*args, **kwargs)
            self._inside += 1
            if self.profile is not None:
                self.profile.enable()
            t0 = self.clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent += self.clock() - t0
                if self.profile is not None:
                    self.profile.disable()
                self._inside -= 1
        return clocked

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def clocked_log(path: str, w: Workload, clock: Callable[[], float]) -> tuple[StepLog, Clocked]:
    """A step log of ``w``'s steps, started, whose host time ``Clocked`` counts: its hooks and,
    once it has named the parameters (its first step), its module hooks' own code (not the
    slow path of ``Module.__call__`` they put the hooked module on: see ``module_hook_seconds``)."""
    log = StepLog(path, model=w.model, optimizer=w.opt)
    clocked = Clocked(clock=clock)
    clocked.wrap(log, OPTIMIZER_HOOKS + OTHER_HOOKS)
    log.start()
    if log._inputs is not None:  # looked up again at each outermost call once learned
        clocked.wrap(log._inputs, MODULE_HOOKS)
    return log, clocked


def step_of(w: Workload) -> Callable[[], None]:
    def step() -> None:
        loss = w.loss()
        loss.backward()
        w.opt.step()
        w.opt.zero_grad(set_to_none=True)
    return step


def module_calls(w: Workload) -> int:
    """Module calls in one forward."""
    calls = [0]

    def count(module: torch.nn.Module, args: Any) -> None:
        calls[0] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        with torch.no_grad():
            w.loss()
    finally:
        handle.remove()
    return calls[0]


def forward_seconds(w: Workload) -> float:
    t0 = time.thread_time()
    with torch.no_grad():
        w.loss()
    return time.thread_time() - t0


def module_hook_seconds(w: Workload, pairs: int) -> list[float]:
    """What the log's module hooks add to a forward, once learned (after a first forward): no_grad
    forwards with and without them, alternating; each pair's difference. The hooks' callbacks do
    nothing here (the log's own are timed as ``others``)."""
    inputs = ForwardInputs(lambda tensors: None, lambda: None, threading.get_ident())
    inputs.install()
    try:
        forward_seconds(w)
        inputs.stop_learning()
        for _ in range(3):
            forward_seconds(w)
        diffs = []
        for _ in range(pairs):
            inputs.reset()
            hooked = forward_seconds(w)
            inputs.remove()
            plain = forward_seconds(w)
            inputs.install()
            diffs.append(hooked - plain)
    finally:
        inputs.remove()
    return diffs


def measure(name: str, args: argparse.Namespace, folder: str) -> dict[str, float]:
    w = build(name, torch.device("cpu"), args.batch, args.seq, None, foreach=True)
    step = step_of(w)
    step()
    path = os.path.join(folder, f"{name}.gtsteps")
    log = StepLog(path, model=w.model, optimizer=w.opt)
    profile = cProfile.Profile() if args.profile else None
    optimizer, others = Clocked(profile), Clocked(profile)
    optimizer.wrap(log, OPTIMIZER_HOOKS)
    others.wrap(log, OTHER_HOOKS)
    log.start()
    try:
        for _ in range(2):
            step()
        optimizer.take(), others.take()
        opt_s, other_s = [], []
        for _ in range(args.steps):
            step()
            opt_s.append(optimizer.take())
            other_s.append(others.take())
        tensors = len(w.opt.param_groups[0]["params"]) * 2
        launches = log._digester._fused.launches if log._digester._fused is not None else 0
        steps_logged = log.steps
    finally:
        log.close()
    if profile is not None:
        print(f"--- {name}: the log's hooks over {args.steps} steps (cumulative; times inflated by the profiler) ---")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile_lines)
    opt_us = statistics.median(opt_s) * 1e6
    other_us = statistics.median(other_s) * 1e6
    twin = build(TWINS[name], torch.device("cpu"), args.batch, args.seq, None) if name in TWINS else w
    mod_us = max(0.0, statistics.median(module_hook_seconds(twin, args.forwards)) * 1e6)
    return {"tensors": tensors, "calls": module_calls(w), "optimizer": opt_us, "others": other_us,
            "modules": mod_us, "total": opt_us + other_us + mod_us,
            "launches": launches / max(1, steps_logged)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=["tiny12", "llama-tiny", "llama"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="logged steps timed (default 30)")
    p.add_argument("--forwards", type=int, default=60, help="forward pairs for the module hooks (default 60)")
    p.add_argument("--profile", action="store_true", help="cProfile the log's hooks")
    p.add_argument("--profile-lines", type=int, default=25)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["GRADTRACE_FUSED_INTERPRET"] = "1"  # the device path, on CPU tensors
    no_kernels()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            rows.append((name, measure(name, args, folder)))
    print(f"step log host time per step, device path on the CPU (kernels not run), batch {args.batch} x seq "
          f"{args.seq}, medians of {args.steps} steps / {args.forwards} forward pairs")
    print(f"{'model':<12}{'tensors':>8}{'calls':>7}{'launches':>9}{'optimizer µs':>14}{'others µs':>11}"
          f"{'modules µs':>12}{'total µs':>10}")
    for name, r in rows:
        print(f"{name:<12}{r['tensors']:>8.0f}{r['calls']:>7.0f}{r['launches']:>9.1f}{r['optimizer']:>14.0f}"
              f"{r['others']:>11.0f}{r['modules']:>12.0f}{r['total']:>10.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
