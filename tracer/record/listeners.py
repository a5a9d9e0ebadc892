"""Listeners: how optional features (scoped logs, memory records, numerics) follow the recorder.

The recorder calls each listener at a few points of its hot path. With no listener attached
the cost is one empty-list check per event. A listener must not keep the tensors it is shown
(pass them to on-device work or read metadata, then let go), and must be thread-safe for the
node events, which arrive on autograd engine threads on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from tracer.model import BackwardRun, Call, NodeRun, Trace


class Listener:
    """Base class with no-op events; override what you need."""

    # Whether the listener needs every grad node's run, built-in nodes' too (their hooks are
    # otherwise left out of a trace without checksums or stats: ``trace(node_runs=...)``).
    # None: when the class overrides ``on_node_begin`` or ``on_node_end``.
    needs_node_runs: bool | None = None

    def before_call(self) -> Any:
        """Right before a recorded call runs; the return value comes back in ``on_call``."""
        return None

    def on_call(self, trace: Trace, call: Call, token: Any, outputs: list[torch.Tensor]) -> None:
        """A forward call was recorded (``outputs``: its new output tensors, live)."""

    def on_backward_begin(self, trace: Trace, run: BackwardRun) -> None:
        """A backward run starts (``Tensor.backward``, ``autograd.backward`` or ``autograd.grad``)."""

    def on_backward_end(self, trace: Trace, run: BackwardRun, error: BaseException | None) -> None:
        """A backward run ended, normally or with ``error``."""

    def on_node_begin(self, trace: Trace, node: str, step: NodeRun, grads: tuple[Any, ...]) -> None:
        """A grad node is about to run; ``grads`` are the gradients it received."""

    def on_node_end(self, trace: Trace, node: str, step: NodeRun, grads: tuple[Any, ...]) -> None:
        """A grad node ran; ``grads`` are the gradients it produced."""

    def on_grad_node(self, trace: Trace, name: str, node: Any) -> None:
        """A grad node was named ``name`` (``node``: PyTorch's live node object: do not keep it
        past the call that made it, or its graph stays alive)."""


def needs_node_runs(listener: Listener) -> bool:
    """Whether ``listener`` needs every grad node's run (see ``Listener.needs_node_runs``)."""
    want = listener.needs_node_runs
    if want is not None:
        return want
    cls = type(listener)
    return cls.on_node_begin is not Listener.on_node_begin or cls.on_node_end is not Listener.on_node_end
