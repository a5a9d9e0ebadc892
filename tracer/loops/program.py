"""Running an unmodified program inside a step trace, the way ``python`` runs it (the runner
behind ``gradtrace run``; its arguments, progress display and closing lines are
``export.cli.run``'s).

``sys.argv``, ``__name__ == "__main__"``, ``sys.path[0]``, the exit status and the traceback are
what ``python script.py`` / ``python -m module`` would give. Steps are counted from
``optimizer.step()`` calls (or ``tracer.step()`` marks in the program); see ``tracer.loops.steps``.
A program whose directory holds its own ``export.py`` or ``tracer.py`` (YOLOv5 ships an
``export.py``) imports its own module under that name, as with ``python``, while gradtrace keeps
its own: see ``OwnPackagesSetAside``.
With ``--watch`` the program runs inside a ``WatchedRun`` instead: nothing is traced, the watches
the program creates (``tracer.watch``, the ``WatchCallback``s) are collected, given the report
writer, and closed (their last flags read) when the program ends.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.machinery
import importlib.util
import inspect
import io
import os
import runpy
import sys
import types
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from tracer.features.watch import Watch, registry
from tracer.record.checksums import fused

# This file is tracer/loops/program.py.
_TRACER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")


# ---- the program -------------------------------------------------------------------------------
@dataclass
class Program:
    """What to run: a script path or a module name, and its own arguments."""

    target: str
    is_module: bool
    args: list[str]

    @property
    def stem(self) -> str:
        if self.is_module:
            return self.target.rsplit(".", 1)[-1]
        return os.path.splitext(os.path.basename(self.target))[0] or "trace"


class _ProgramArgv:
    """``sys.argv`` and ``sys.path[0]`` as python sets them for the program, restored after."""

    def __init__(self, program: Program) -> None:
        self.program = program

    def __enter__(self) -> None:
        self._argv, self._path0 = sys.argv, sys.path[0] if sys.path else None
        p = self.program
        sys.argv = [p.target, *p.args]  # for -m, runpy then sets argv[0] to the module's file
        if p.is_module:
            first = os.getcwd()  # `python -m` puts the working directory first
        elif os.path.isdir(p.target):
            first = os.path.realpath(p.target)
        else:  # the script's own directory, symlinks resolved
            first = os.path.dirname(os.path.realpath(p.target))
        if sys.path:
            sys.path[0] = first
        else:
            sys.path.insert(0, first)

    def __exit__(self, *exc: object) -> None:
        sys.argv = self._argv
        if self._path0 is not None and sys.path:
            sys.path[0] = self._path0


class WatchedRun:
    """Collects the watches a program creates (``watches``) and closes them when it ends;
    ``report(trace, path)`` writes the HTML report of each incident."""

    def __init__(self, report: Callable[[Any, str], object] | None = None) -> None:
        self.report = report
        self.watches: list[Watch] = []

    def __enter__(self) -> WatchedRun:
        self.watches = registry.collect(self.report)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            for w in self.watches:
                if not w.closed:
                    w.close()  # reads the last flags: a trip there raises like any other
        finally:
            registry.stop()


# ---- gradtrace's packages and the program's own modules of the same names ----------------------
GRADTRACE_PACKAGES = ("tracer", "export")


def _first_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """What a fresh ``import name`` would load now (with the program's ``sys.path``), asked of
    the import system's finders in order, as ``import`` asks them."""
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, None)
        except (ImportError, ValueError, AttributeError):  # a third-party finder's trouble
            continue
        if spec is not None:
            return spec
    return None


def _same_file(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


class OwnPackagesSetAside:
    """While the program runs, ``import export`` / ``import tracer`` in it gives what python
    would give it: when its ``sys.path`` finds another module first (the script's directory holds
    its own ``export.py``, as YOLOv5's does), gradtrace's modules of that name are taken out of
    ``sys.modules`` for the run and put back after it. gradtrace's own code keeps working: its
    modules hold their imports already (``preload`` imports the few that are otherwise imported
    on first use), so nothing of gradtrace is looked up by name while the program runs."""

    def __init__(self) -> None:
        self.set_aside: dict[str, types.ModuleType] = {}
        self.shadowed: list[str] = []

    def __enter__(self) -> OwnPackagesSetAside:
        for name in GRADTRACE_PACKAGES:
            own = sys.modules.get(name)
            spec = _first_spec(name) if own is not None else None
            # Nothing found: nothing else could be imported either. A namespace package (no
            # origin) found first is what python would import, so it counts as another module.
            if spec is None or _same_file(spec.origin, getattr(own, "__file__", None)):
                continue
            if name == "tracer":
                preload()
            self.shadowed.append(name)
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                self.set_aside[key] = sys.modules.pop(key)
        _forget_files(self.set_aside)
        return self

    def __exit__(self, *exc: object) -> None:
        gone = []
        for name in self.shadowed:  # the program's modules of those names go, gradtrace's come back
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
                gone.append(key)
        _forget_files(gone)
        sys.modules.update(self.set_aside)
        self.set_aside.clear()


def _forget_files(names: Iterable[str]) -> None:
    """Drop ``inspect``'s memory of which file each named module came from. ``inspect.getmodule``
    (torch calls it while importing, e.g. ``torch._dynamo`` at the first optimizer) compares each
    module's ``__file__`` with that memory: a program's namespace ``export`` (``__file__`` None)
    under a name remembered with gradtrace's file would send it into ``getfile``, which raises.
    Private to inspect: where it is missing, there is nothing to forget."""
    remembered = getattr(inspect, "_filesbymodname", None)
    if isinstance(remembered, dict):
        for name in names:
            remembered.pop(name, None)


def preload() -> None:
    """Import now what gradtrace's recording otherwise imports on first use, before gradtrace's
    ``tracer`` is set aside: the Triton checksum kernels (``--hash fast`` on a GPU)."""
    if fused.triton_usable() and torch.cuda.is_available():
        fused.kernels()


def execute(program: Program, context: AbstractContextManager[object]) -> int:
    """Run the program inside ``context`` (a ``StepTrace``, a ``WatchedRun``); the exit status
    python would give."""
    with _ProgramArgv(program), OwnPackagesSetAside():
        try:
            with context:
                if program.is_module:
                    runpy.run_module(program.target, run_name="__main__", alter_sys=True)
                elif os.path.isfile(program.target) and not _is_zip(program.target):
                    _run_script(program.target)
                else:  # a directory or zip file with __main__.py
                    runpy.run_path(program.target, run_name="__main__")
        except SystemExit as exc:
            return _exit_status(exc)
        except KeyboardInterrupt as exc:
            _print_exception(exc)
            return 130
        except BaseException as exc:
            _print_exception(exc)
            return 1
    return 0


def _is_zip(path: str) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"


def _run_script(path: str) -> None:
    """Run a script file as ``python path`` does.

    Not ``runpy.run_path``: that sets ``sys.argv[0]`` to the path it is given, while python keeps
    argv[0] as typed and makes ``__file__`` (and so every traceback and traced stack) absolute.
    """
    full = os.path.abspath(path)
    with io.open_code(full) as fh:
        source = fh.read()
    # dont_inherit: this module's `from __future__ import annotations` must not leak into it.
    code = compile(source, full, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=full, __cached__=None, __spec__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", full),
                         __builtins__=builtins)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): python prints it and exits 1
    return 1


def _print_exception(exc: BaseException) -> None:
    """The traceback python would print: from the program's own frame on, without the frames
    of gradtrace's hooks that the exception passed through."""
    frames = []
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    while len(frames) > 1 and (frames[0].tb_frame.f_code.co_filename == __file__
                               or frames[0].tb_frame.f_globals.get("__name__") == "runpy"):
        frames.pop(0)
    # By file, not module name: the program may have a `tracer` package of its own.
    kept = [f for f in frames if not f.tb_frame.f_code.co_filename.startswith(_TRACER_DIR)] or frames
    kept = _without_mode_dispatch(kept)
    rebuilt: TracebackType | None = None
    for f in reversed(kept):
        rebuilt = TracebackType(rebuilt, f.tb_frame, f.tb_lasti, f.tb_lineno)
    sys.stderr.flush()
    exc.__traceback__ = rebuilt  # the default hook prints the exception's own traceback
    sys.excepthook(type(exc), exc, rebuilt)


def _without_mode_dispatch(frames: list[TracebackType]) -> list[TracebackType]:
    """``frames`` without the detour a torch function takes to reach the trace's mode: a Python
    function of torch (``F.batch_norm``) that handed itself to ``handle_torch_function``, which
    called it again under the mode. A plain run shows that function once, at the line that
    raised; so does this."""
    dispatch = torch.overrides.handle_torch_function.__code__
    kept: list[TracebackType] = []
    i = 0
    while i < len(frames):
        f = frames[i]
        if (f.tb_frame.f_code is dispatch and kept and i + 1 < len(frames)
                and frames[i + 1].tb_frame.f_code is kept[-1].tb_frame.f_code):
            kept.pop()  # the function's first entry, at its handle_torch_function line
            i += 1  # and the dispatch itself
            continue
        kept.append(f)
        i += 1
    return kept
