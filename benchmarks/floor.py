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
- ``+minimal records``: the node walk, and the least a Python recorder keeps per object (one
  tuple record per call, grad node and tensor value, the value's metadata read once, a weak
  reference by identity; no stacks, versions, aliases or scopes): a lower bound on bookkeeping;
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
import weakref
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
                self.walk(t.grad_fn)
        return out

    def walk(self, root: Any) -> None:
        """Visit the nodes reachable from ``root`` not visited before, ``hook`` on each."""
        todo = [root]
        seen = self.seen
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            if self.hook is not None:
                self.hook(node)
            todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


class _RecordsMode(_NodeMode):
    """A lower bound on any Python recorder that keeps one record per object: the node walk,
    and per call, grad node and returned tensor value the least such a record needs. A call:
    its inputs' names looked up by identity, a counter name, a tuple record appended. A tensor
    value: its metadata read once (shape, strides, dtype, device, requires_grad, version), a
    tuple record stored under a fresh name, and a weak reference by identity (a trace must not
    hold the tensor, and must not mistake a recycled id for it). A grad node: its sequence
    number, class and edges, a tuple record. No stacks, versions, aliases, module scopes or
    optimizer grouping (gradtrace records an optimizer step as one call): every call's
    returned tensors are records here, so its count of objects is printed beside it."""

    last: _RecordsMode | None = None  # the latest one made (overhead.py reads its count)

    def __init__(self) -> None:
        super().__init__(self._node_record)
        _RecordsMode.last = self
        self._call = ""  # the call whose new nodes the walk is visiting
        self.calls: list[tuple[Any, ...]] = []
        self.tensors: dict[str, tuple[Any, ...]] = {}
        self.names: dict[int, tuple[Any, str]] = {}
        self.nodes: list[tuple[Any, ...]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        with torch._C.DisableTorchFunction():
            names = self.names
            ins = []
            for a in args:
                if type(a) is torch.Tensor or type(a) is torch.nn.Parameter:
                    hit = names.get(id(a))
                    if hit is None or hit[0]() is not a:  # first seen (a parameter): a record too
                        hit = self._record(a, f"input{len(self.tensors)}")
                    ins.append(hit[1])
            call = f"{getattr(func, '__name__', 'op')}{len(self.calls)}"
            outs = out if isinstance(out, (tuple, list)) else (out,)
            out_names = []
            for i, t in enumerate(outs):
                if not isinstance(t, torch.Tensor):
                    continue
                out_names.append(self._record(t, f"{call}:{i}")[1])
                if t.grad_fn is not None:
                    self._call = call
                    self.walk(t.grad_fn)
            self.calls.append((call, ins, out_names))
        return out

    def _node_record(self, node: Any) -> None:
        self.nodes.append((node._sequence_nr(), type(node).__name__, self._call,
                           tuple(id(n) for n, _ in node.next_functions)))

    def _record(self, t: torch.Tensor, name: str) -> tuple[Any, str]:
        self.tensors[name] = (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t._version)
        entry = self.names[id(t)] = (weakref.ref(t), name)
        return entry

    def objects(self) -> int:
        return len(self.calls) + len(self.nodes) + len(self.tensors)


def minimal_records_objects() -> int:
    """Objects the latest ``+minimal records`` row recorded (0 if none ran)."""
    last = _RecordsMode.last
    return last.objects() if last is not None else 0


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
        "+minimal records": lambda: _with_module_hooks(_RecordsMode()),
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


def objects_line(w: Any) -> str:
    """What one step gives the ``+minimal records`` row and gradtrace's lean trace: calls + grad
    nodes + tensor values each (the rows' costs are per object)."""
    minimal = _RecordsMode()
    with _with_module_hooks(minimal):
        w.step()
    with tracer.trace(hash="none", stacks=False) as tr:
        w.step()
    return (f"objects per step: +minimal records {len(minimal.calls)} + {len(minimal.nodes)} + "
            f"{len(minimal.tensors)} = {minimal.objects()}; gradtrace {len(tr.calls)} + {len(tr.grad_nodes)} + "
            f"{len(tr.tensors)} = {len(tr.calls) + len(tr.grad_nodes) + len(tr.tensors)}")


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
    print(objects_line(w))
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
