"""User ``TorchDispatchMode``s (FlopCounterMode, DebugMode, selective activation checkpointing's
caching modes, a numerics checker of one's own) must not see gradtrace's own tensor ops: the
checksums and stats read every recorded value with ``detach``, ``aminmax``, ``sum``, ``.item()``...
Seen by such a mode, they would be logged or counted as the model's, and a mode that caches
ops by order (selective checkpointing replays what it saved, op by op) could be thrown off.

So gradtrace's own work pops every dispatch mode while any is active, and puts them back after
(``torch.utils._python_dispatch._disable_current_modes``, private and feature-detected: where it
is missing the modes stay, as before). The check costs one C call. ``tracer.record.own_work``
does this together with switching torch-function modes off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

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
