"""The Python code a recorded backward runs, under the recorder's mode.

``Tensor.backward`` and ``torch.autograd.grad`` reach the recorder through its mode's handler,
where the mode is off, and the autograd engine runs every node with the torch-function state it
found when it started (on this thread, and handed to the threads that run CUDA nodes). So tensor
hooks, module backward hooks, post-accumulate-grad hooks and the forward that non-reentrant
checkpointing recomputes all ran unseen. The engine's entry (``torch.autograd._engine_run_backward``,
private: where a torch lacks it, nothing changes) is wrapped while a trace is active, and a
backward the recorder started gets a mode of that recorder around the engine call (a compiled
region's backward stays one opaque node). gradtrace's own hooks turn torch functions off for
themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tracer.record.mode import BackwardRecordingMode, top_recording_mode

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder

_AUTOGRAD: Any = torch.autograd  # its engine entry is not exported (typed as Any)
_ORIGINAL: Callable[..., Any] | None = getattr(_AUTOGRAD, "_engine_run_backward", None)
# The recorder whose backward this thread is about to start (set by record_backward just before
# it calls the public function, taken by the engine's entry).
_starting = threading.local()


def expect_backward(rec: Recorder | None) -> None:
    """The next engine start on this thread belongs to ``rec``'s backward (None: no longer)."""
    _starting.rec = rec


def _traced_engine_run_backward(*args: Any, **kwargs: Any) -> Any:
    assert _ORIGINAL is not None
    rec = getattr(_starting, "rec", None)
    _starting.rec = None
    if rec is None or rec.closed or top_recording_mode() is not None:
        return _ORIGINAL(*args, **kwargs)
    with BackwardRecordingMode(rec):
        return _ORIGINAL(*args, **kwargs)


def install_engine_wrapper() -> None:
    if _ORIGINAL is not None:
        _AUTOGRAD._engine_run_backward = _traced_engine_run_backward


def uninstall_engine_wrapper() -> None:
    if _ORIGINAL is not None and _AUTOGRAD._engine_run_backward is _traced_engine_run_backward:
        _AUTOGRAD._engine_run_backward = _ORIGINAL
    _starting.rec = None
