"""Call-stack capture on the hot path, symbolised later.

Per call we walk ``sys._getframe()`` and keep ``(code object, f_lasti)`` pairs, interned so a
distinct frame is stored once and a distinct stack once; file names, line numbers and source
text are looked up only when the trace is finalised (``symbolize``). Frames inside torch and
inside gradtrace itself are library internals and are dropped by default, so the last frame of
a stack is the user's line that made the call.

The walk stops early at a *scope*: a frame the recorder knows to be executing (the frame that
runs a module's forward, from its pre-hook to its post-hook), whose callers were read once when
the scope opened. A call deep inside a model then walks a handful of frames, not all of them.
"""

from __future__ import annotations

import inspect
import linecache
import os
import sys
from types import CodeType, FrameType
from typing import Protocol

import torch

from tracer.model import Frame
from tracer.record.identity import identity

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# gradtrace's own packages: tracer/ (this file is tracer/record/stacks.py) and export/ beside it.
_TRACER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_DIRS = (_TRACER_DIR + os.sep, os.path.join(os.path.dirname(_TRACER_DIR), "export") + os.sep)
_INTERNAL_PREFIXES = (_TORCH_DIR, *_OWN_DIRS)
# Frames of Python's own machinery (contextlib's __exit__, threading) are never the user's line.
# The bundled demo model lives inside the package but is user code for the purpose of stacks.
_DEMO_SUFFIX = os.path.join("tracer", "demo.py")
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
_STDLIB_NOISE = ("<frozen ", os.sep + "contextlib.py", os.sep + "runpy.py",
                 os.sep + "bin" + os.sep + "gradtrace")


class _Scope:
    """A frame known to be executing, its own user callers ``(code, f_lasti)`` up to the
    enclosing scope (innermost first) and that scope (``parent``; None: none). ``prefix``: the
    number, among the table's distinct prefixes, of the whole chain of its callers' frame ids,
    once a capture has needed it (``StackTable._intern_prefix``)."""

    __slots__ = ("callers", "frame", "parent", "prefix")

    def __init__(self, frame: FrameType, callers: tuple[tuple[CodeType, int], ...], parent: _Scope | None) -> None:
        self.frame = frame
        self.callers = callers
        self.parent = parent
        self.prefix: int | None = None


class StackTable:
    """Interns frames and stacks. Not thread-safe by itself: the recorder holds its lock."""

    def __init__(self, keep_internal: bool = False) -> None:
        self.keep_internal = keep_internal
        # Keyed by the code object's identity (tracer.record.identity, not id(): no audit event per
        # frame): code objects compare *equal by content* (the file name is not part of it), so
        # two identical functions in different files would share an entry. The code objects
        # themselves are kept in _frame_keys / _codes, so their identities cannot be reused.
        self._frame_ids: dict[tuple[int, int], int] = {}
        self._frame_keys: list[tuple[CodeType, int]] = []
        self._codes: list[CodeType] = []
        self._stack_ids: dict[tuple[int, ...], int] = {}
        self.stacks: list[tuple[int, ...]] = []
        self._internal: dict[int, bool] = {}
        # Scopes: frames that stay on the stack for a while (the module call wrapper's frame,
        # from the forward pre-hook to the post-hook), each with the user frames above it. A
        # capture walks only up to the innermost scope it meets: the frames above a frame that is
        # still executing cannot have changed (each is suspended in the call below it). The frame
        # object itself is held, so its id cannot be reused meanwhile.
        self._scopes: dict[FrameType, _Scope] = {}  # frames hash and compare by identity
        # Stacks that end inside a scope, by (prefix number, frames below the scope): a short key
        # instead of the whole stack (the same layer code runs under twelve module calls, whose
        # scopes are distinct objects with equal frames above them). A prefix is numbered by its
        # enclosing scope's prefix number and the frames between the two, so that a scope
        # (a module call) costs the frames of its own call, not a copy of every frame above it.
        self._prefix_ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self._prefixes: list[tuple[int, ...]] = []  # each prefix's frame ids, outermost first
        self._by_prefix: dict[tuple[int, tuple[int, ...]], int] = {}

    def _is_internal(self, code: CodeType) -> bool:
        hit = self._internal.get(identity(code))
        if hit is None:
            fn = code.co_filename
            hit = fn.startswith(_INTERNAL_PREFIXES) or any(n in fn for n in _STDLIB_NOISE)
            if self.keep_internal or fn.endswith(_DEMO_SUFFIX):
                hit = False
            self._internal[identity(code)] = hit
            self._codes.append(code)
        return hit

    def capture(self, skip: int = 1, frame: FrameType | None = None) -> int:
        """Intern the current user stack (outermost first) and return its id.

        Frames of torch and gradtrace are dropped by file, so ``skip`` only saves walking them.
        """
        if frame is None:
            try:
                frame = sys._getframe(skip)
            except ValueError:  # a shallower stack than expected (python -c at module level)
                frame = sys._getframe(1)
        inner, scope = self._user_frames(frame)
        if scope is None:
            return self._intern_stack(inner)
        prefix = scope.prefix if scope.prefix is not None else self._intern_prefix(scope)
        key = (prefix, inner)
        sid = self._by_prefix.get(key)
        if sid is None:
            sid = self._by_prefix[key] = self._intern_stack(self._prefixes[prefix] + inner)
        return sid

    def _intern_stack(self, stack: tuple[int, ...]) -> int:
        sid = self._stack_ids.get(stack)
        if sid is None:
            sid = self._stack_ids[stack] = len(self.stacks)
            self.stacks.append(stack)
        return sid

    def _intern_prefix(self, scope: _Scope) -> int:
        """The prefix number of ``scope``'s callers (and of each enclosing scope not numbered
        yet). Frame ids are handed out innermost first, at the first capture that reaches a
        frame, exactly as a full walk would: the saved frame table does not depend on scopes."""
        chain: list[tuple[_Scope, tuple[int, ...]]] = []  # scopes to number, innermost first
        s: _Scope | None = scope
        while s is not None and s.prefix is None:
            ids = [self._frame_id(code, lasti) for code, lasti in s.callers]
            ids.reverse()
            chain.append((s, tuple(ids)))
            s = s.parent
        pid = -1 if s is None or s.prefix is None else s.prefix
        prefixes = self._prefixes
        for s, own in reversed(chain):
            key = (pid, own)
            hit = self._prefix_ids.get(key)
            if hit is None:
                hit = self._prefix_ids[key] = len(prefixes)
                prefixes.append(prefixes[pid] + own if pid >= 0 else own)
            s.prefix = pid = hit
        return pid

    def _frame_id(self, code: CodeType, lasti: int) -> int:
        """The interned id of one frame (``_user_frames`` inlines this in its hot loop)."""
        key = (identity(code), lasti)
        fid = self._frame_ids.get(key)
        if fid is None:
            fid = self._frame_ids[key] = len(self._frame_keys)
            self._frame_keys.append((code, lasti))
        return fid

    def _user_frames(self, frame: FrameType | None) -> tuple[tuple[int, ...], _Scope | None]:
        """Interned ids of the user frames from ``frame`` outwards, outermost first, up to the
        innermost scope met (returned too: its frames come above these)."""
        f = frame
        ids: list[int] = []
        frame_ids = self._frame_ids
        internal = self._internal
        scopes = self._scopes
        scope: _Scope | None = None
        while f is not None:
            code = f.f_code
            is_int = internal.get(identity(code))
            if is_int is None:
                is_int = self._is_internal(code)
            if not is_int:
                lasti = f.f_lasti
                key = (identity(code), lasti)
                fid = frame_ids.get(key)
                if fid is None:
                    fid = frame_ids[key] = len(self._frame_keys)
                    self._frame_keys.append((code, lasti))
                ids.append(fid)
            if scopes:
                hit = scopes.get(f)
                if hit is not None:
                    scope = hit
                    break
            f = f.f_back
        ids.reverse()
        return tuple(ids), scope

    def open_scope(self, frame: FrameType) -> FrameType | None:
        """Remember ``frame``'s callers until ``close_scope(frame)``; the caller guarantees that
        ``frame`` keeps executing (stays on the stack) until then. Returns ``frame`` (None: not
        a scope), for the caller to close."""
        if frame.f_code.co_flags & _RESUMABLE:  # a generator's callers change at each resume
            return None
        callers: list[tuple[CodeType, int]] = []
        internal = self._internal
        scopes = self._scopes
        f = frame.f_back
        parent: _Scope | None = None
        while f is not None:
            code = f.f_code
            is_int = internal.get(identity(code))
            if is_int is None:
                is_int = self._is_internal(code)
            if not is_int:
                callers.append((code, f.f_lasti))
            hit = scopes.get(f)
            if hit is not None:
                parent = hit
                break
            f = f.f_back
        self._scopes[frame] = _Scope(frame, tuple(callers), parent)
        return frame

    def close_scope(self, frame: FrameType | None) -> None:
        if frame is not None:
            self._scopes.pop(frame, None)

    def clear_scopes(self) -> None:
        """Let go of every held frame (the trace is ending)."""
        self._scopes.clear()

    @property
    def frame_count(self) -> int:
        return len(self._frame_keys)

    def frames_of(self, stack_id: int | None) -> tuple[Frame, ...]:
        """Symbolise one stack now (for error messages raised while recording)."""
        if stack_id is None or stack_id >= len(self.stacks):
            return ()
        return tuple(self._symbol(fid) for fid in self.stacks[stack_id])

    def _symbol(self, fid: int) -> Frame:
        code, lasti = self._frame_keys[fid]
        key = (id(code), lasti)
        entry = _SYMBOLS.get(key)
        hit = entry[1] if entry is not None and entry[0] is code else None
        if hit is None:
            line = _line_of(code, lasti)
            src = linecache.getline(code.co_filename, line).strip() if line else ""
            hit = Frame(code.co_filename, line, getattr(code, "co_qualname", code.co_name), src)
            if len(_SYMBOLS) < _SYMBOLS_MAX:
                _SYMBOLS[key] = (code, hit)  # holding the code keeps its id from being reused
        return hit

    def symbolize(self, start: int = 0) -> list[Frame]:
        """Turn interned frames ``start..`` into ``Frame`` records (file, line, function, code)."""
        return [self._symbol(fid) for fid in range(start, len(self._frame_keys))]


class Stacks(Protocol):
    """What the recorder asks of its stack table (``StackTable``, or ``NoStacks`` when stacks are
    off): one table object either way, so no caller tests whether stacks are on."""

    stacks: list[tuple[int, ...]]

    def capture(self, skip: int = 1, frame: FrameType | None = None) -> int | None: ...
    def open_scope(self, frame: FrameType) -> FrameType | None: ...
    def close_scope(self, frame: FrameType | None) -> None: ...
    def clear_scopes(self) -> None: ...
    def frames_of(self, stack_id: int | None) -> tuple[Frame, ...]: ...
    def symbolize(self, start: int = 0) -> list[Frame]: ...


class NoStacks:
    """The stack table of a trace without stacks (``stacks=False``): every capture is None, no
    frame is held, nothing is symbolised."""

    def __init__(self) -> None:
        self.stacks: list[tuple[int, ...]] = []

    def capture(self, skip: int = 1, frame: FrameType | None = None) -> int | None:
        return None

    def open_scope(self, frame: FrameType) -> FrameType | None:
        return None

    def close_scope(self, frame: FrameType | None) -> None:
        pass

    def clear_scopes(self) -> None:
        pass

    def frames_of(self, stack_id: int | None) -> tuple[Frame, ...]:
        return ()

    def symbolize(self, start: int = 0) -> list[Frame]:
        return []


# Symbolised frames, shared by every trace of the process: a training loop traced at many steps
# walks the same code, and looking up lines and source text once per distinct frame is enough.
_SYMBOLS: dict[tuple[int, int], tuple[CodeType, Frame]] = {}
_SYMBOLS_MAX = 200_000


def _line_of(code: CodeType, lasti: int) -> int:
    # f_lasti is the offset of the instruction being executed; co_lines maps offset ranges to
    # lines. An offset of -1 (a frame not started) falls back to the first line.
    for start, end, line in code.co_lines():
        if start <= lasti < end and line is not None:
            return line
    return code.co_firstlineno


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by the caller point at the innermost frame
    outside gradtrace and torch: the user's line (where a bound was reached, say), as a warning
    of the user's own code would. Walks frames only when a warning is issued (rare)."""
    frame: FrameType | None = sys._getframe(1)  # the function that calls warnings.warn: stacklevel 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_PREFIXES):
        frame = frame.f_back
        level += 1
    return level


def raised_in_backward_python(exc: BaseException) -> Frame | None:
    """Where ``exc`` was raised, when Python code the autograd engine ran raised it (a hook, a
    custom backward): the innermost user frame past the engine's entry in its traceback. None
    when it came from the engine's C++ itself (a built-in node) or no user frame is there."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    entry = max((i for i, (code, _) in enumerate(frames)
                 if code.co_name == "_engine_run_backward" and code.co_filename.startswith(_TORCH_DIR)), default=None)
    if entry is None:
        return None
    for code, line in reversed(frames[entry + 1:]):
        fn = code.co_filename
        if not fn.startswith(_INTERNAL_PREFIXES) or fn.endswith(_DEMO_SUFFIX):
            src = linecache.getline(fn, line).strip()
            return Frame(fn, line, getattr(code, "co_qualname", code.co_name), src)
    return None

