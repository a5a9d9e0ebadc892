"""The floor of a Python recorder: what its hook points cost with nothing recorded.

gradtrace sees a step through three hook points: a TorchFunctionMode (every torch call),
global module forward hooks (module scopes) and a hook on every grad node (the backward). This
times the benchmark step of ``overhead.py`` under those hook points doing nothing, next to
gradtrace itself, in one process with the configurations taking turns:

- ``mode``: an empty TorchFunctionMode (``return func(*args, **kwargs)``);
- ``mode+modules``: and empty global module forward pre- and post-hooks;
- ``+node walk``: and, after each call, a walk from its outputs' ``grad_fn`` to the grad nodes
  not seen before (what naming and linking the nodes must visit), registering nothing;
- ``+Python node hooks``: and a no-op Python post-hook on every such node;
- ``+C++ node hooks`` (``--native``; needs a C++ compiler and ninja, builds with
  ``torch.utils.cpp_extension.load_inline``): the walk and a no-op hook both in C++ instead;
- ``C++ op observer`` (``--native``): no Python at all, a native RecordFunction callback (the
  profiler's hook point) keeping the name and sequence number of every ATen op and grad-node
  run: the floor of a native recording core (whose names would be ATen's, not the Python
  API's), before any tensor identity or stack;
- ``gradtrace ...``: the shipped recorder, graph and names only, then with stacks.

The difference between a floor row and gradtrace's row is the recorder's own bookkeeping; a
floor row above a target means no bookkeeping, however lean, can meet that target through those
hook points.

On CUDA it also prints the floor of fingerprinting every tensor: the bytes of all the tensor
values one traced step records, and how long the GPU takes to read that many bytes once at the
read rate measured here (a max-reduction over a 4 GiB buffer) -- GPU time that checksums on
the step's own stream add to it at the least.

    python benchmarks/floor.py                                          # tiny12 on the CPU
    python benchmarks/floor.py --device cuda --model gpt2-small --native
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import tracer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import default_workload, recorded_bytes, time_step  # a sibling script, not a package

NATIVE_SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <unordered_set>
using torch::autograd::Node;
using torch::autograd::variable_list;
static std::unordered_set<Node*> seen;
static int64_t calls = 0;
struct NoopHook : torch::autograd::FunctionPostHook {
  variable_list operator()(const variable_list& outputs, const variable_list& inputs) override {
    ++calls;
    return outputs;
  }
};
// Hook the grad nodes reachable from t.grad_fn() that were not hooked before.
int64_t hook_new(const at::Tensor& t) {
  std::vector<Node*> todo;
  int64_t n = 0;
  if (t.grad_fn()) todo.push_back(t.grad_fn().get());
  while (!todo.empty()) {
    Node* node = todo.back();
    todo.pop_back();
    if (!seen.insert(node).second) continue;
    node->add_post_hook(std::make_unique<NoopHook>());
    ++n;
    for (const auto& e : node->next_edges()) if (e.function) todo.push_back(e.function.get());
  }
  return n;
}
// Node addresses are reused once a graph is freed: forget them between steps.
int64_t reset() { seen.clear(); auto c = calls; calls = 0; return c; }

// A native recorder's floor: a RecordFunction observer (the profiler's hook point) that sees
// every ATen op and every grad-node run with no Python on the way, and keeps each one's name
// and sequence number (nothing formatted, no tensor identities: those would cost more).
#include <ATen/record_function.h>
#include <mutex>
static std::vector<std::pair<const char*, int64_t>> events;
static std::mutex events_mutex;  // backward runs ops on the autograd engine's threads too
static at::CallbackHandle observer = 0;
static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  std::lock_guard<std::mutex> lock(events_mutex);
  events.emplace_back(fn.name(), fn.seqNr());
  return nullptr;
}
void observe() {
  events.reserve(1 << 16);
  observer = at::addGlobalCallback(at::RecordFunctionCallback(on_enter)
      .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}
int64_t unobserve() {
  at::removeCallback(observer);
  int64_t n = (int64_t)events.size();
  events.clear();
  return n;
}
"""


def _noop_hook(tag: int, grad_inputs: Any, grad_outputs: Any) -> None:
    return None


class _EmptyMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return func(*args, **(kwargs or {}))


class _NodeMode(TorchFunctionMode):
    """After each call, visit the grad nodes its outputs lead to that were not visited before;
    ``hook`` (if any) is applied to each once. Nodes are held until the block ends."""

    def __init__(self, hook: Callable[[Any], None] | None,
                 native: Callable[[torch.Tensor], int] | None = None) -> None:
        super().__init__()
        self.hook = hook
        self.native = native
        self.seen: set[Any] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        with torch._C.DisableTorchFunction():
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t in outs:
                if not isinstance(t, torch.Tensor) or t.grad_fn is None:
                    continue
                if self.native is not None:
                    self.native(t)
                    continue
                todo = [t.grad_fn]
                seen = self.seen
                while todo:
                    node = todo.pop()
                    if node in seen:
                        continue
                    seen.add(node)
                    if self.hook is not None:
                        self.hook(node)
                    todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        return out


def _python_hook(node: Any) -> None:
    node.register_hook(functools.partial(_noop_hook, 0))


@contextlib.contextmanager
def _with_module_hooks(mode: TorchFunctionMode, after: Callable[[], Any] | None = None) -> Iterator[None]:
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(lambda m, a: None),
               register_module_forward_hook(lambda m, a, o: None)]
    try:
        with mode:
            yield
    finally:
        for h in handles:
            h.remove()
        if after is not None:
            after()


@contextlib.contextmanager
def _observing(native: Any) -> Iterator[None]:
    native.observe()
    try:
        yield
    finally:
        native.unobserve()


Factory = Callable[[], contextlib.AbstractContextManager[Any]]


def hook_point_rows(native: Any = None) -> dict[str, Factory]:
    """The floor rows, label -> context manager factory: gradtrace's hook points doing nothing
    (an empty TorchFunctionMode; and empty module hooks; and the walk to each call's new grad
    nodes; and a no-op Python hook on every such node), and with ``native`` (the C++ extension
    of ``build_native()``) the C++ node hooks and op observer. ``overhead.py --suite`` times the
    last three Python rows beside gradtrace's."""
    rows: dict[str, Factory] = {
        "mode": _EmptyMode,
        "mode+modules": lambda: _with_module_hooks(_EmptyMode()),
        "+node walk": lambda: _with_module_hooks(_NodeMode(None)),
        "+Python node hooks": lambda: _with_module_hooks(_NodeMode(_python_hook)),
    }
    if native is not None:
        rows["+C++ node hooks"] = lambda: _with_module_hooks(_NodeMode(None, native.hook_new), native.reset)
        rows["C++ op observer"] = lambda: _observing(native)
    return rows


def configurations(native: Any) -> dict[str, Factory]:
    rows: dict[str, Factory] = {"plain": contextlib.nullcontext, **hook_point_rows(native)}
    rows['gradtrace hash="none", stacks=False'] = lambda: tracer.trace(hash="none", stacks=False)
    rows['gradtrace hash="none"'] = lambda: tracer.trace(hash="none")
    return rows


def step_bytes(w: Any) -> tuple[int, int]:
    """(tensor values, their bytes) one traced step records: what ``hash="fast"`` reads."""
    with tracer.trace(hash="none", stacks=False, stats=False) as tr:
        w.step()
    return len(tr.tensors), recorded_bytes(tr)


def read_rate(device: torch.device, nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """Bytes per second the GPU reads in a max-reduction over ``nbytes`` (best of ``repeats``)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        buf.amax()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000.0)
    del buf
    return nbytes / best


def build_native() -> Any:
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline("gradtrace_floor_hooks", cpp_sources=NATIVE_SOURCE, functions=["hook_new", "reset", "observe", "unobserve"])
    except Exception as exc:  # no compiler, no ninja, no headers: the row is left out
        print(f"C++ node hooks left out: cannot build ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="tiny12 on the CPU, gpt2-small on CUDA by default")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--native", action="store_true", help="add the C++ node-hook row")
    args = p.parse_args(argv)
    model, w = default_workload(args.device, args.model)
    device = w.device
    rows = configurations(build_native() if args.native else None)
    counter = _NodeMode(None)
    with counter:
        w.step()
    print(f"torch {torch.__version__}, {device} ({model}); {len(counter.seen)} grad nodes per step")
    for make in rows.values():  # warm-up
        for _ in range(2):
            time_step(w, make)
    wall: dict[str, list[float]] = {k: [] for k in rows}
    body: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.repeats):
        for key, make in rows.items():
            ms, body_ms, _ = time_step(w, make)
            wall[key].append(ms)
            body[key].append(body_ms)
    base = statistics.median(wall["plain"])
    print(f"median of {args.repeats} rounds\n")
    print("| hook points | median ms | ratio | body ms |\n|---|---:|---:|---:|")
    for key in rows:
        ms = statistics.median(wall[key])
        print(f"| {key} | {ms:.2f} | {ms / base:.2f} | {statistics.median(body[key]):.2f} |")
    if device.type == "cuda":
        count, nbytes = step_bytes(w)
        rate = read_rate(device)
        read_ms = nbytes / rate * 1000.0
        print(f"\n{count} tensor values, {nbytes / 1e9:.1f} GB per traced step; the GPU reads "
              f"{rate / 1e12:.2f} TB/s (max-reduction over 4 GiB), so reading them once takes "
              f"{read_ms:.1f} ms = +{read_ms / base:.2f}x the plain step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
