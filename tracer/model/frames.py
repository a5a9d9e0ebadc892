"""Which frames of a stack are the user's: every frame gets a class from its file path.

``frame_class(path)`` returns one of:

- ``"user"``: the user's code (a script, a notebook cell, a test file, gradtrace's demo model);
- ``"library"``: an installed package (``site-packages``/``dist-packages``) or Python's
  standard library;
- ``"framework"``: PyTorch (``torch``, ``functorch``, ``torchgen``, ``triton``) or gradtrace
  itself (``tracer``, ``export``);
- ``"kernel"``: the machinery that runs a notebook cell (``ipykernel``, ``IPython``,
  ``tornado``, ``zmq``, ``traitlets``, ``jupyter_client``, ``asyncio``...).

The class is derived when a trace is read or shown, not stored: the file keeps every frame, and
the paths alone decide. A package is recognised by the directory right under ``site-packages``
(or ``dist-packages``); Python's standard library by ``lib/pythonX.Y/``; and, on the machine
that reads the trace, by the install directories of torch and gradtrace found here (a source
checkout of either is not under ``site-packages``). Notebook cells (``/tmp/ipykernel_N/M.py``,
``<ipython-input-...>``) are the user's.

``folded(frames)`` says which frames a short view shows: the user's frames and the innermost
frame (where the call was made, often a library's line), the rest folded. ``user_frame(frames)``
is the one line to name when there is room for one: the user's innermost frame.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sysconfig
from collections import Counter
from collections.abc import Iterator, Sequence
from functools import lru_cache

from tracer.model.records import Frame

USER = "user"
LIBRARY = "library"
FRAMEWORK = "framework"
KERNEL = "kernel"
CLASSES = (USER, LIBRARY, FRAMEWORK, KERNEL)
# How a folded run of frames is described ("2 notebook kernel frames").
CLASS_LABELS = {USER: "user", LIBRARY: "library", FRAMEWORK: "framework", KERNEL: "notebook kernel"}

FRAMEWORK_PACKAGES = frozenset({"torch", "functorch", "torchgen", "triton", "tracer", "export"})
KERNEL_PACKAGES = frozenset({"ipykernel", "IPython", "tornado", "zmq", "traitlets", "jupyter_client", "jupyter_core",
                             "comm", "debugpy", "nest_asyncio", "ipywidgets", "jupyter_server", "nbclient",
                             "_pydevd_bundle", "_pydev_bundle", "pydevd.py"})
# Standard-library packages that only run the notebook's event loop.
KERNEL_STDLIB = frozenset({"asyncio", "selectors.py"})

_SEP = r"[\\/]"
_PACKAGES_DIR = re.compile(_SEP + r"(?:site|dist)-packages" + _SEP + r"([^\\/]+)")
_STDLIB_DIR = re.compile(_SEP + r"lib" + _SEP + r"python\d+(?:\.\d+)?t?" + _SEP + r"([^\\/]+)", re.IGNORECASE)
_NOTEBOOK_CELL = re.compile(r"<ipython-input-|" + _SEP + r"ipykernel_\d+" + _SEP)


def _local_dir(package: str) -> str | None:
    """The directory of an installed package on this machine, without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(next(iter(spec.submodule_search_locations)), "")


# This file is tracer/model/frames.py: gradtrace's own packages are tracer/ and export/ beside it.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OWN_DIRS = tuple(os.path.join(_ROOT, p, "") for p in ("tracer", "export"))
_DEMO = os.path.join(_ROOT, "tracer", "demo.py")
_TORCH_DIR = _local_dir("torch")
_FRAMEWORK_DIRS = (*_OWN_DIRS, *((_TORCH_DIR,) if _TORCH_DIR else ()))
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")


@lru_cache(maxsize=4096)
def frame_class(path: str) -> str:
    """The class of a frame from its file path: ``user``, ``library``, ``framework`` or ``kernel``."""
    if _NOTEBOOK_CELL.search(path):
        return USER
    if path == _DEMO or path.endswith(os.path.join("tracer", "demo.py")):
        return USER  # the bundled demo model stands for the user's code
    if path.startswith(_FRAMEWORK_DIRS):
        return FRAMEWORK
    found = _PACKAGES_DIR.search(path)
    if found:
        top = found.group(1)
        name = top[:-3] if top.endswith(".py") else top
        if name in FRAMEWORK_PACKAGES:
            return FRAMEWORK
        return KERNEL if top in KERNEL_PACKAGES or name in KERNEL_PACKAGES else LIBRARY
    stdlib_top = path[len(_STDLIB):].split(os.sep, 1)[0] if path.startswith(_STDLIB) else None
    if stdlib_top is None:
        found = _STDLIB_DIR.search(path)
        stdlib_top = found.group(1) if found else None
    if stdlib_top is not None:
        return KERNEL if stdlib_top in KERNEL_STDLIB else LIBRARY
    if path.startswith("<frozen "):
        return LIBRARY
    return USER


def folded(frames: Sequence[Frame]) -> list[bool]:
    """For each frame (outermost first), whether a short view folds it away: everything but the
    user's frames and the innermost frame."""
    last = len(frames) - 1
    return [i != last and not is_user_frame(f) for i, f in enumerate(frames)]


def user_frame(frames: Sequence[Frame]) -> Frame | None:
    """The line to name for a record in one line: the user's innermost frame (the line they wrote
    that made the call, also when the call ran inside a library), else the innermost frame;
    None for an empty stack."""
    for f in reversed(frames):
        if is_user_frame(f):
            return f
    return frames[-1] if frames else None


def is_user_frame(frame: Frame) -> bool:
    """Whether ``frame`` is the user's code (``frame_class``), leaving out code Python generates
    at run time: a dataclass's ``__init__`` (file ``<string>``, function ``__create_fn__...``),
    whose calls are its class's (a library's ``__post_init__``), not the user's. (Other
    ``<string>`` code, ``python -c`` or an ``exec`` of the user's, stays the user's.)"""
    return frame_class(frame.file) == USER and not (frame.file.startswith("<") and "__create_fn__" in frame.function)


def short_line(frame: Frame) -> str:
    """``train.py:42: loss = model(x)``: a frame in one short line (file name, line, source)."""
    name = frame.file.replace("\\", "/").rsplit("/", 1)[-1]
    return f"{name}:{frame.line}: {frame.code}" if frame.code else f"{name}:{frame.line}"


def fold_label(frames: Sequence[Frame]) -> str:
    """``3 frames folded (2 library, 1 notebook kernel)`` for a run of folded frames."""
    counts = Counter(frame_class(f.file) for f in frames)
    parts = ", ".join(f"{counts[c]} {CLASS_LABELS[c]}" for c in CLASSES if counts[c])
    noun = "frame" if len(frames) == 1 else "frames"
    return f"{len(frames)} {noun} folded ({parts})"


def fold_runs(frames: Sequence[Frame], hide: Sequence[bool]) -> Iterator[Frame | list[Frame]]:
    """The frames a short view shows, in order, and between them each run of frames it hides as
    one list (``hide`` from ``folded``, which never hides the innermost frame)."""
    run: list[Frame] = []
    for f, hidden in zip(frames, hide):
        if hidden:
            run.append(f)
            continue
        if run:
            yield run
            run = []
        yield f
    if run:
        yield run


def stack_lines(frames: Sequence[Frame], all_frames: bool = False, indent: str = "  ") -> list[str]:
    """A stack as Python prints a traceback (``File "x", line N, in f`` and the source line, most
    recent call last); unless ``all_frames``, each run of folded frames is one line instead."""
    hide = [False] * len(frames) if all_frames else folded(frames)
    lines: list[str] = []
    for f in fold_runs(frames, hide):
        if isinstance(f, list):
            lines.append(f"{indent}... {fold_label(f)}")
            continue
        lines.append(f'{indent}File "{f.file}", line {f.line}, in {f.function}')
        if f.code:
            lines.append(f"{indent}  {f.code}")
    return lines


__all__ = ["CLASSES", "CLASS_LABELS", "FRAMEWORK", "KERNEL", "LIBRARY", "USER", "fold_label", "fold_runs", "folded",
           "frame_class", "is_user_frame", "short_line", "stack_lines", "user_frame"]
