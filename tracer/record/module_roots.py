"""What the code that calls a root module (a module called while no other module runs) knows
about it: the module whose method made the call (a LightningModule's ``training_step`` calling
``self.generator(z)``, a VAE's ``encode`` calling ``self.encoder(x)``), and the name the caller
holds it by (``D`` in ``D(fake)``, ``self.student`` on a plain trainer object).

Parameters are named by module path from the first root module called, so that a model called
whole gets ``model.named_parameters()``'s names. A part of a model called on its own would
otherwise become that root itself (its parameters named as if the part were the model), and a
second model called in the same block (a GAN's discriminator, a distillation's student) was
prefixed by its class (``Sequential.0.weight``), which says nothing about which model it is.

Only the caller's own frame is read (one copy of its locals when a root is first met, once per
trace and model): no search over the live objects."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import NamedTuple

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MAX_FRAMES = 24  # torch's and gradtrace's frames between the module's call and the hook


class Caller(NamedTuple):
    """What the user's frame that called a root module holds: a copy of its locals, and the
    object whose method it runs (its first parameter: ``self``, whatever its name; None for a
    function without parameters or module-level code)."""

    local_vars: dict[str, object]
    bound: object


def _user_frames(f: FrameType | None) -> Iterator[Caller]:
    """What each of the user's frames from ``f`` outwards holds, innermost first: torch's and
    gradtrace's frames are skipped, and after ``_MAX_FRAMES`` of those in a row the walk ends."""
    skipped = 0
    while f is not None and skipped < _MAX_FRAMES:
        code = f.f_code
        if code.co_filename.startswith((_TORCH_DIR, _OWN_DIR)):
            skipped += 1
        else:
            skipped = 0
            local_vars = frame_locals(f)
            yield Caller(local_vars, local_vars.get(code.co_varnames[0]) if code.co_argcount else None)
        f = f.f_back


def _frame(depth: int) -> FrameType | None:
    """The frame ``depth`` levels above the caller of the caller of this function."""
    try:
        return sys._getframe(depth + 2)
    except ValueError:
        return None


def caller(depth: int) -> Caller | None:
    """The innermost of the user's frames from ``depth`` outwards (torch's and gradtrace's
    skipped), read once."""
    return next(_user_frames(_frame(depth)), None)


# A function's frame keeps the dict ``f_locals`` returns, a snapshot of its locals, until the
# frame ends or the next read refreshes it (before Python 3.13, PEP 667): read once, it would
# keep alive what the function holds now (a batch, a loss and its graph) after the function
# drops it, for as long as the training loop's function runs.
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)
_CO_OPTIMIZED = 0x1  # inspect.CO_OPTIMIZED: a function's frame, whose f_locals is a snapshot


# References to a snapshot no one else holds: the frame's, frame_locals' own and getrefcount's
# argument. The user's code holds it too when it kept what ``locals()`` returned (the same dict).
_SNAPSHOT_ALONE = 3


def frame_locals(frame: FrameType) -> dict[str, object]:
    """A copy of ``frame``'s locals that leaves nothing held by the frame: a function frame's
    snapshot is emptied after the copy (the next ``locals()`` there fills it again), unless the
    function keeps it itself (``ns = locals()``: emptying it would change the program); a
    module's or class body's namespace is the real one and is left alone."""
    snapshot = frame.f_locals
    values = dict(snapshot)
    if _SNAPSHOT_LOCALS and frame.f_code.co_flags & _CO_OPTIMIZED and snapshot is not frame.f_globals \
            and sys.getrefcount(snapshot) <= _SNAPSHOT_ALONE:
        snapshot.clear()
    return values


def _is_module(value: object) -> bool:
    # type(), not isinstance(): isinstance reads __class__, which some module-level objects
    # answer with a deprecation warning (see tracer.record.owners).
    return issubclass(type(value), torch.nn.Module)


def _parts(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module.modules()``; none for a module being built or copied (no ``_modules`` yet)."""
    try:
        return list(module.modules())
    except AttributeError:
        return []


def _holds(container: torch.nn.Module, module: torch.nn.Module) -> bool:
    return any(m is module for m in _parts(container))


def enclosing_module(caller: Caller, module: torch.nn.Module) -> torch.nn.Module | None:
    """The model ``module`` is a part of, as far as the calling frame shows: the module whose
    method the frame runs, when it holds ``module`` (``self.encoder(x)`` in a VAE's
    ``encode``); else, when the frame holds ``module`` by no name of its own
    (``model.encoder(x)``, ``checkpoint_sequential(model, ...)`` calling ``model[0]``), the
    smallest module the frame (or the object whose method it runs) holds that contains it. A
    module the frame calls by a name of its own is a model of its own, even when another one
    holds it too (an ``AveragedModel`` of it)."""
    owner = caller.bound
    if isinstance(owner, torch.nn.Module) and owner is not module and _holds(owner, module):
        return owner
    held = list(caller.local_vars.values())
    attrs = getattr(owner, "__dict__", None) if owner is not None and not _is_module(owner) else None
    if isinstance(attrs, dict):
        held += attrs.values()
    if any(v is module for v in held):
        return None
    best: torch.nn.Module | None = None
    best_size = 0
    for v in held:
        if not _is_module(v) or not isinstance(v, torch.nn.Module):  # (type() first: see _is_module)
            continue
        parts = _parts(v)
        if (best is None or len(parts) < best_size) and any(m is module for m in parts):
            best, best_size = v, len(parts)
    return best


def name_in_caller(caller: Caller, module: torch.nn.Module) -> str | None:
    """The name ``frame`` holds ``module`` by: a local variable, else an attribute of the object
    whose method it runs (``self.disc``); None when it has none (``make_model()(x)``)."""
    owner = caller.bound
    for name, value in caller.local_vars.items():
        if value is module and value is not owner and name.isidentifier():
            return name
    attrs = getattr(owner, "__dict__", None) if owner is not None else None
    if isinstance(attrs, dict):
        for name, value in attrs.items():
            if value is module and isinstance(name, str) and name.isidentifier():
                return name
    if isinstance(owner, torch.nn.Module):
        for name, value in owner._modules.items():
            if value is module and name.isidentifier():
                return name
    return None


def name_in_callers(module: torch.nn.Module, depth: int, frames: int = 6) -> str | None:
    """The name the nearest of the user's frames from ``depth`` outwards holds ``module`` by
    (looking at ``frames`` of them at most): for a model met through one of its own methods
    (an EMA's ``update(model)``, whose frame holds it as ``self``), its caller's ``ema``."""
    for held in itertools.islice(_user_frames(_frame(depth)), frames):
        held_as = name_in_caller(held, module)
        if held_as is not None:
            return held_as
    return None


def compiled_model(module: torch.nn.Module) -> torch.nn.Module | None:
    """The model ``torch.compile`` wrapped, where ``module`` is its wrapper (``OptimizedModule``,
    which holds it as ``_orig_mod``); else None. By the class's name: importing torch._dynamo to
    test the class takes seconds."""
    if type(module).__name__ != "OptimizedModule":
        return None
    inner = module.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if isinstance(inner, torch.nn.Module) else None


def parameter_path(module: torch.nn.Module, prefix: str, p: torch.Tensor) -> str | None:
    """The path of parameter ``p`` in ``module`` (whose own path is ``prefix``), if it holds it."""
    for name, q in module.named_parameters(prefix=prefix, remove_duplicate=False):
        if q is p:
            return name
    return None


def swaps_parameters(modules: Iterable[torch.nn.Module]) -> bool:
    """Whether one of ``modules`` is managed by FSDP2 (``fully_shard``), which swaps every
    parameter object for its unsharded form around each forward and backward by design. The
    class is looked up, not imported: importing torch.distributed.fsdp takes seconds."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    managed = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return isinstance(managed, type) and any(isinstance(m, managed) for m in modules)
