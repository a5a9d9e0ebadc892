"""User ``TorchDispatchMode``s (FlopCounterMode, DebugMode, selective activation checkpointing's
caching modes, a numerics checker of one's own) must not see gradtrace's own tensor ops: the
checksums and stats read every recorded value with ``detach``, ``aminmax``, ``sum``, ``.item()``...
Seen by such a mode, they would be logged or counted as the model's, and a mode that caches
ops by order (selective checkpointing replays what it saved, op by op) could be thrown off.

So the hasher pops every dispatch mode around its own work while any is active, and puts them
back after (``torch.utils._python_dispatch._disable_current_modes``, private and
feature-detected: where it is missing the modes stay, as before). The check costs one C call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_stack_len: Callable[[], int] | None = getattr(torch._C, "_len_torch_dispatch_stack", None)
try:
    from torch.utils import _python_dispatch

    _disable: Callable[[], contextlib.AbstractContextManager[Any]] | None = getattr(
        _python_dispatch, "_disable_current_modes", None)
except ImportError:  # pragma: no cover - depends on the torch version
    _disable = None


def dispatch_modes_active() -> bool:
    """Whether a Python dispatch mode is on this thread's stack (and can be popped)."""
    return _disable is not None and _stack_len is not None and _stack_len() > 0


def dispatch_modes_off() -> contextlib.AbstractContextManager[Any]:
    """A context in which ops run past every Python dispatch mode (restored on exit)."""
    return _disable() if _disable is not None else contextlib.nullcontext()


F = TypeVar("F", bound=Callable[..., Any])


def past_dispatch_modes(fn: F) -> F:
    """``fn`` run with every dispatch mode popped when any is on the stack (one C call when none
    is): for gradtrace's own reads of tensor values."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if dispatch_modes_active():
            with dispatch_modes_off():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return run  # type: ignore[return-value]
