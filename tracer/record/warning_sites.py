"""Warnings raised inside a traced op point at the user's line, as without gradtrace.

Python attributes a warning to a frame: ``warnings.warn(..., stacklevel=n)`` to the n-th frame
up, and PyTorch's C++ ``TORCH_WARN`` (through ``PyErr_WarnEx`` with stacklevel 1) to the
innermost Python frame. Inside a trace the op is called by the recording mode's handler, so both
land on gradtrace's own frame (``capture.py``, the line that runs the op), with gradtrace's
module name and warning registry: the user sees the wrong line, and filters such as
``ignore::UserWarning:mymodule`` or the once-per-location registry act on the wrong place.

Nothing is done per op (no frame walk, no ``catch_warnings``): the cost is paid only when a
warning is raised. Two process-wide pieces, installed when the first trace starts:

- a filter ``always`` for warnings attributed to gradtrace's recording modules, so that such a
  warning reaches the display step untouched (no filter or registry decides on the wrong place);
- a wrapper around ``warnings._showwarnmsg`` (the function CPython's C warning code and
  ``warnings.warn`` both call to display a warning; ``catch_warnings(record=True)`` and pytest
  replace what it calls, not it). When the warning is attributed to a live frame of the
  recording handler, the wrapper finds the frame that called the traced op and re-issues the
  warning there with ``warnings.warn_explicit``, with that frame's module and registry: the
  user's filters, ``once``/``default`` registries and ``catch_warnings`` see it exactly as they
  would without gradtrace. Any other warning passes through unchanged.

The filter is re-added at each trace start if a ``catch_warnings`` block dropped it.

One warning is gradtrace's own doing: torch warns, each time a compiled module is called, that
global module hooks will fire an extra time for it. When the only global module hooks are the
recorder's (which take the compiled module's call as one opaque call), that warning is ignored
for the block (a filter added at its start and removed at its end), so that ``-W error`` test
suites and logs see what they see without gradtrace.
"""

from __future__ import annotations

import re
import sys
import threading
import warnings
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, cast

import torch.overrides

from tracer.record.autograd import Graph
from tracer.record.capture import PythonCapture
from tracer.record.mode import RecordingMode
from tracer.record.recorder import Recorder

# The frames that run a traced op: the mode's handler and the recorder methods it calls.
_HANDLER: CodeType = RecordingMode.__torch_function__.__code__
_RUNNERS: frozenset[CodeType] = frozenset({_HANDLER, PythonCapture.record_call.__code__,
                                           Graph.record_backward.__code__})
_RUNNER_FILES = frozenset(c.co_filename for c in _RUNNERS)
# A Python-level torch function (F.softmax, Tensor.__format__...) reaches the handler through
# handle_torch_function; the op's caller is the one that called that public function.
_DISPATCH_FILE = torch.overrides.__file__
_MODULE_PATTERN = r"tracer\.record\.(capture|mode|autograd)\Z"

_lock = threading.Lock()
_original_show: Callable[[warnings.WarningMessage], None] | None = None


def install() -> None:
    """Make sure the filter and the display wrapper are in place (cheap when they are)."""
    global _original_show
    with _lock:
        if not any(f[0] == "always" and f[3] is not None and f[3].pattern == _MODULE_PATTERN
                   for f in warnings.filters):
            warnings.filterwarnings("always", module=_MODULE_PATTERN)
        # Wrapped once per process: a later wrapper installed by someone else over ours is left
        # alone (wrapping it again would make each call the other's original: endless recursion).
        if _original_show is None:
            _original_show = warnings._showwarnmsg  # type: ignore[attr-defined]
            warnings._showwarnmsg = _show  # type: ignore[attr-defined]


def _show(msg: warnings.WarningMessage) -> None:
    site = _user_site(msg) if msg.filename in _RUNNER_FILES else None
    if site is None:
        assert _original_show is not None
        _original_show(msg)
        return
    globs = site.f_globals
    registry = globs.setdefault("__warningregistry__", {})
    warnings.warn_explicit(msg.message, msg.category, site.f_code.co_filename, site.f_lineno,
                           module=globs.get("__name__", "<unknown>"), registry=registry,
                           source=msg.source)


def _user_site(msg: warnings.WarningMessage) -> FrameType | None:
    """The frame that called the traced op the warning was raised in, or None when the warning
    was not attributed to a frame that runs an op."""
    f: FrameType | None = sys._getframe(1)
    attributed = False
    while f is not None:
        code = f.f_code
        if code in _RUNNERS and f.f_lineno == msg.lineno and code.co_filename == msg.filename:
            attributed = True
        if code is _HANDLER and attributed:
            caller = f.f_back
            if caller is not None and caller.f_code.co_filename == _DISPATCH_FILE:
                caller = caller.f_back  # handle_torch_function
                caller = caller.f_back if caller is not None else None  # the public torch function
            return caller
        f = f.f_back
    return None


_GLOBAL_HOOKS_WARNING = "Using `torch.compile(module)` when there are global hooks"


def quiet_global_hooks_warning(rec: Recorder) -> Callable[[], None] | None:
    """Ignore torch's warning about global module hooks while ``rec``'s are the only ones;
    returns what removes the filter again (None: other global hooks exist, the warning stays).

    The filter goes into ``warnings.filters`` directly, without ``_filters_mutated()``: that
    call (made by ``filterwarnings``) resets every module's once-per-location registry, and a
    warning of the user's program (a deprecation in a module it calls) then printed again at
    every traced step. A new "ignore" filter needs no reset: an ignored warning is never
    entered in a registry, and what the registries hold stays true."""
    if not rec.scopes.holds_every_global_module_hook():
        return None
    entry = ("ignore", re.compile(re.escape(_GLOBAL_HOOKS_WARNING), re.I), UserWarning, None, 0)
    filters = cast(list[Any], warnings.filters)  # a list at run time
    filters.insert(0, entry)

    def undo() -> None:
        if entry in filters:
            filters.remove(entry)

    return undo
