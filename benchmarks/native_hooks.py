"""Research, not shipped: what grad-node hooks cost in Python against C++.

The recorder puts a Python hook on every grad node. Would a native extension make the backward
side cheap? This builds a tiny C++ post-hook with ``torch.utils.cpp_extension.load_inline``
(needs a C++ compiler and ninja; ~20 s the first time) and times, on tiny12's graph (the call
structure of GPT-2 small), registering a no-op hook on every node and running backward:
no hooks, Python hooks, C++ hooks. The difference between them is the hook mechanism's own
cost; everything else the recorder spends per node is its bookkeeping.

    python benchmarks/native_hooks.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import build  # a sibling script, not a package

SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <unordered_set>
using torch::autograd::Node;
using torch::autograd::variable_list;
static int64_t calls = 0;
struct DoneHook : torch::autograd::FunctionPostHook {
  variable_list operator()(const variable_list& outputs, const variable_list& inputs) override {
    ++calls;
    return outputs;
  }
};
int64_t hook_graph(const at::Tensor& root) {
  std::vector<Node*> todo;
  std::unordered_set<Node*> seen;
  if (!root.grad_fn()) return 0;
  todo.push_back(root.grad_fn().get());
  while (!todo.empty()) {
    Node* node = todo.back();
    todo.pop_back();
    if (!seen.insert(node).second) continue;
    node->add_post_hook(std::make_unique<DoneHook>());
    for (const auto& e : node->next_edges()) if (e.function) todo.push_back(e.function.get());
  }
  return (int64_t)seen.size();
}
int64_t taken() { auto n = calls; calls = 0; return n; }
"""


def _nodes(loss: torch.Tensor) -> list[Any]:
    out, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        out.append(n)
        todo += [x for x, _ in n.next_functions]
    return out


def main() -> int:
    from torch.utils.cpp_extension import load_inline

    t0 = time.perf_counter()
    try:
        native = load_inline("gradtrace_native_hooks", cpp_sources=SOURCE, functions=["hook_graph", "taken"])
    except Exception as exc:  # no compiler, no ninja, no headers
        print(f"cannot build the C++ hook ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(f"built in {time.perf_counter() - t0:.1f} s; torch {torch.__version__}")
    torch.set_num_threads(1)
    w = build("tiny12", torch.device("cpu"), None, None, None, foreach=True)

    def python_hooks(loss: torch.Tensor) -> int:
        nodes = _nodes(loss)
        for n in nodes:
            n.register_hook(lambda grad_inputs, grad_outputs: None)
        return len(nodes)

    ways: dict[str, Callable[[torch.Tensor], int] | None] = {
        "no hooks": None, "Python hooks": python_hooks, "C++ hooks": native.hook_graph}
    print("| hooks | nodes | register ms | backward ms |\n|---|---:|---:|---:|")
    for label, hook in ways.items():
        reg, bwd, n = [], [], 0
        for _ in range(15):
            loss = w.model(input_ids=w.ids, labels=w.ids).loss
            t0 = time.perf_counter()
            n = hook(loss) if hook is not None else 0
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            reg.append(t1 - t0)
            bwd.append(t2 - t1)
            native.taken()
        print(f"| {label} | {n} | {statistics.median(reg) * 1e3:.2f} | {statistics.median(bwd) * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
