"""Tensors of ``torch.func`` transforms (``grad``, ``vmap``, ``jvp``, ``jacrev``, ``hessian``...).

Inside a transform, tensors are functorch wrappers (``TensorWrapper`` for grad and jvp,
``BatchedTensor`` for vmap) with no storage of their own, and every op, ours included, goes
through the transform's interpreters: a checksum's ``.item()`` under ``vmap`` or its write into a
staging buffer under ``grad`` raises there. So the hasher reads what a wrapper wraps, one level at
a time down to a plain tensor, with the transforms switched off around its own ops.

Every name used here is private torch API (``torch._C._functorch``, ``torch._C._DisableFuncTorch``),
feature-detected: where one is missing, wrapped tensors are not hashed and say why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

_functorch_c: Any = getattr(torch._C, "_functorch", None)
_is_wrapped: Callable[[torch.Tensor], bool] | None = getattr(_functorch_c, "is_functorch_wrapped_tensor", None)
_get_unwrapped: Callable[[torch.Tensor], torch.Tensor] | None = getattr(_functorch_c, "get_unwrapped", None)
_is_batched: Callable[[torch.Tensor], bool] | None = getattr(_functorch_c, "is_batchedtensor", None)
_is_functional: Callable[[torch.Tensor], bool] | None = getattr(_functorch_c, "is_functionaltensor", None)
_maybe_bdim: Callable[[torch.Tensor], int] | None = getattr(_functorch_c, "maybe_get_bdim", None)
# Whether any transform is running on this thread: None when none is (one C call, ~0.1 us).
_peek_interpreter: Callable[[], Any] | None = getattr(_functorch_c, "peek_interpreter_stack", None)
_disable_functorch: Callable[[], Any] | None = getattr(torch._C, "_DisableFuncTorch", None)

# Wrappers nest one level per transform (grad(vmap(f)) makes two); more than this is a loop.
_MAX_LEVELS = 64


def _no_transform() -> None:
    return None


# The innermost running transform's interpreter, None when none runs: the C function itself where
# torch has it (the recorder asks at every call: one C call, no Python frame).
current_transform: Callable[[], Any] = _peek_interpreter if _peek_interpreter is not None else _no_transform


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform is running on this thread."""
    return current_transform() is not None


def is_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch wrapper (a tensor of a transform, or one that escaped it)."""
    if _is_wrapped is None:
        return False
    try:
        return bool(_is_wrapped(t))
    except (RuntimeError, TypeError):
        return False


def transforms_off() -> contextlib.AbstractContextManager[Any]:
    """A context in which ops run on plain tensors, past every transform's interpreter."""
    return _disable_functorch() if _disable_functorch is not None else contextlib.nullcontext()


def unwrap(t: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """The plain tensor a functorch wrapper holds, and a note on what its values are.

    ``(t, None)`` for a tensor that is not wrapped. Under ``vmap`` the plain tensor holds every
    batch entry (the batch dimension inserted where the note says), so its checksum and stats
    cover the whole batch. ``(None, reason)`` where it cannot be unwrapped. Call it with the
    transforms off (``transforms_off``)."""
    if not is_wrapped(t):
        return t, None
    if _get_unwrapped is None:
        return None, "torch.func wrapper (this torch cannot unwrap it)"
    batch_dims: list[int] = []
    x = t
    try:
        for _ in range(_MAX_LEVELS):
            if not is_wrapped(x):
                break
            if _is_functional is not None and _is_functional(x):
                return None, "functionalized tensor (torch.func.functionalize)"
            if _is_batched is not None and _is_batched(x):
                batch_dims.append(_maybe_bdim(x) if _maybe_bdim is not None else -1)
            x = _get_unwrapped(x)
        else:
            return None, "torch.func wrapper nested too deep"
    except (RuntimeError, TypeError) as exc:
        return None, f"torch.func wrapper ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    if not batch_dims:
        return x, None
    dims = ", ".join(str(d) for d in batch_dims)
    shape = "x".join(str(s) for s in x.shape) or "scalar"
    return x, (f"vmap: checksum and stats of every batch entry together (the batched {shape} tensor, "
               f"batch dim {dims})")


def unwrapped_grad_fns(tensors: list[torch.Tensor], grad_fns: list[Any]) -> list[Any]:
    """``grad_fns`` (of ``tensors``, made inside a transform), with the grad node of the plain
    tensor a wrapper holds where the wrapper shows none: under ``vmap`` autograd records the ops
    on the batched values, so a call's node is on what its output wraps."""
    out = list(grad_fns)
    with transforms_off():
        for i, (t, fn) in enumerate(zip(tensors, grad_fns)):
            if fn is None and is_wrapped(t):
                plain, _ = unwrap(t)
                if plain is not None:
                    try:
                        out[i] = plain.grad_fn
                    except RuntimeError:
                        pass
    return out
