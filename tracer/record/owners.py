"""The model a parameter belongs to, for a parameter the trace meets before any module of its
model has been called (weight clipping before the critic's forward, an EMA update or an
initialisation first in the block, a block that starts with ``optimizer.step()``).

Parameters are named by the module tree they are registered in, which the recorder learns when
a module is called. A parameter met earlier would be named ``input<k>`` for the whole trace
(its gradient ``input<k>@grad``, the optimizer's reads ``input<k>@v1``). So the recorder asks
here for the outermost module that holds it, among the live objects (one ``gc.get_objects()``
pass, ~100 ms beside GPT-2 small's 410k objects, paid only in this case, a few times per trace
at most, and what it finds kept for later traces), and names that module's tree then, as if it
had been called first.
"""

from __future__ import annotations

import gc
import sys
import weakref
from types import FrameType

import torch

from tracer.record.weakmap import IdWeakMap

# What the searches found, by identity (a tensor's == compares values): each parameter a live
# module held, with that module's root, and each parameter no module held then. A loop that
# traces every step and meets its parameters first (weight clipping at the top of the step), or
# a functional model of standalone parameters, searches once, not once per trace.
_FOUND: IdWeakMap[weakref.ref[torch.nn.Module]] = IdWeakMap()
_NO_MODULE: IdWeakMap[bool] = IdWeakMap()


def constructing_a_module() -> bool:
    """Whether a module's ``__init__`` is running on this thread (its parameters are being made
    and initialised, and it is not yet attached to the model that will hold it: no root found
    now would be the model's)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "__init__" and isinstance(f.f_locals.get("self"), torch.nn.Module):
            return True
        f = f.f_back
    return False


def owning_root_module(p: torch.Tensor, search: bool = True) -> torch.nn.Module | None:
    """The outermost ``nn.Module`` that holds ``p`` as a parameter (following ``_modules`` up
    from the module that registers it), or None when no live module does (as of the last search
    that saw ``p``). ``search=False``: only what earlier searches found."""
    root = _found(p)
    if root is None and search and needs_search(p):
        _search_all()
        root = _found(p)
    return root


def needs_search(p: torch.Tensor) -> bool:
    """Whether no search has placed ``p`` yet (in a module, or in none)."""
    return _found(p) is None and _NO_MODULE.get(p) is None


def _found(p: torch.Tensor) -> torch.nn.Module | None:
    ref = _FOUND.get(p)
    return ref() if ref is not None else None


def _search_all() -> None:
    """One pass over the live objects: every module's parameters with their root module, and
    every parameter no module holds."""
    # type(), not isinstance(): isinstance reads __class__, which some module-level objects
    # answer with a deprecation warning (torch.distributed.reduce_op).
    module_type, parameter_type = torch.nn.Module, torch.nn.Parameter
    modules: list[torch.nn.Module] = []
    parameters: list[torch.Tensor] = []
    kinds: dict[type, int] = {}  # 1 module, 2 parameter, 0 neither: one issubclass per type
    for o in gc.get_objects():
        cls = type(o)
        kind = kinds.get(cls)
        if kind is None:
            kind = kinds[cls] = 1 if issubclass(cls, module_type) else 2 if issubclass(cls, parameter_type) else 0
        if kind == 1:
            modules.append(o)
        elif kind == 2:
            parameters.append(o)
    # A module being built or copied (``copy.deepcopy`` of a model inside the block makes its
    # objects before their attributes) has no ``_modules`` or ``_parameters`` yet: read through
    # __dict__, which such a module has, not through Module.__getattr__, which raises.
    parent: dict[int, torch.nn.Module] = {}
    for m in modules:
        for child in (vars(m).get("_modules") or {}).values():
            if child is not None and id(child) not in parent and child is not m:
                parent[id(child)] = m
    roots: dict[int, weakref.ref[torch.nn.Module]] = {}
    for m in modules:
        held = [v for v in (vars(m).get("_parameters") or {}).values() if v is not None]
        if not held:
            continue
        key = id(m)
        if key not in roots:
            root, seen = m, {id(m)}
            while id(root) in parent and id(parent[id(root)]) not in seen:  # (a cycle of modules ends the walk)
                root = parent[id(root)]
                seen.add(id(root))
            roots[key] = weakref.ref(root)
        for v in held:
            if _found(v) is None:
                _FOUND[v] = roots[key]
    global _NO_MODULE
    _NO_MODULE = IdWeakMap()  # as of this search: a parameter attached since is found again
    for q in parameters:
        if _found(q) is None:
            _NO_MODULE[q] = True
