"""The end of each backward pass: a step boundary for loops without an optimizer
(``step_on="backward"``), and where the step log learns the loss each pass started from.

Tutorial loops update parameters by hand (``p.data.add_(p.grad, alpha=-lr)``: pytorch/examples'
word language model by default), so no ``optimizer.step()`` ever ends a step. PyTorch has no
global hook on the end of a backward pass; ``Tensor.backward`` and ``torch.autograd.backward``
are Python functions that every ``loss.backward()`` goes through (Lightning's and Accelerate's
backward call them too), so while a step trace counts backward passes (or a step log is open) they are wrapped: when the
outermost call returns on the thread that traces, the callback runs with the tensors the pass
started from, outside every recorder frame (the recording mode's handler for the call has
returned by then). ``torch.autograd.grad``
is not a pass that ends a step (a gradient penalty, a Hessian-vector product).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


class BackwardEnds:
    """While installed, ``on_end(roots)`` runs after each outermost ``Tensor.backward`` or
    ``torch.autograd.backward`` call that returns (one that raises ends nothing) on ``thread``;
    ``roots`` are the tensors the pass started from (the loss)."""

    def __init__(self, on_end: Callable[[Sequence[torch.Tensor]], None], thread: int) -> None:
        self.on_end = on_end
        self.thread = thread
        self._depth = threading.local()
        self._originals: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, original, wrapper)

    def install(self) -> None:
        for owner in (torch.Tensor, torch.autograd):
            original = owner.backward
            wrapper = self._wrap(original)
            setattr(owner, "backward", wrapper)  # noqa: B010 (a class or a module: one loop for both)
            self._originals.append((owner, "backward", original, wrapper))

    def remove(self) -> None:
        for owner, attr, original, wrapper in reversed(self._originals):
            if getattr(owner, attr) is wrapper:  # (left alone if someone patched it after us)
                setattr(owner, attr, original)
        self._originals.clear()

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        local = self._depth

        # functools.wraps keeps the original's name, qualified name and module: the recorder
        # names the call from them (Tensor.backward, torch.autograd.backward).
        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, "n", 0)
            local.n = depth + 1
            try:
                out = original(*args, **kwargs)
            finally:
                local.n = depth
            # Nested: Tensor.backward calls torch.autograd.backward, and the recording mode's
            # handler calls the wrapper again; only the outermost return ends a pass.
            if depth == 0 and threading.get_ident() == self.thread:
                self.on_end(_roots(args, kwargs))
            return out

        return backward


def _roots(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a pass starts from: ``Tensor.backward``'s self, ``torch.autograd.backward``'s
    ``tensors`` (one tensor or a sequence)."""
    first = args[0] if args else kwargs.get("tensors")
    if isinstance(first, torch.Tensor):
        return [first]
    if isinstance(first, list | tuple):
        return [t for t in first if isinstance(t, torch.Tensor)]
    return []
