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

from tracer.record.identity import identity

# What the searches found, by identity (a tensor's == compares values): each parameter a live
# module held, as (the module that registers it, its key there, that module's root), and each
# parameter no module held then. A loop that traces every step and meets its parameters first
# (weight clipping at the top of the step) searches once, not once per trace. No weak reference
# to a parameter is kept past its trace: ``torch.utils.swap_tensors`` (``Module.to`` with
# ``torch.__future__.set_swap_module_params_on_conversion(True)``, FSDP2's set-up) refuses a
# tensor that has one. A parameter is told apart from a later object at the same address by
# asking its module whether it still holds it, and a standalone one by its tensor's own address.
_FOUND: dict[int, tuple[weakref.ref[torch.nn.Module], str, weakref.ref[torch.nn.Module]]] = {}
_NO_MODULE: dict[int, int] = {}  # identity -> _tensor_key


def _tensor_key(p: torch.Tensor) -> int:
    """The address of ``p``'s C++ tensor (private ``_cdata``; else its data's address)."""
    key = getattr(p, "_cdata", None)
    return int(key) if isinstance(key, int) else p.data_ptr()


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
    return _found(p) is None and _NO_MODULE.get(identity(p)) != _tensor_key(p)


def _found(p: torch.Tensor) -> torch.nn.Module | None:
    hit = _FOUND.get(identity(p))
    if hit is None:
        return None
    holder, key, root = hit[0](), hit[1], hit[2]()
    if holder is None or (vars(holder).get("_parameters") or {}).get(key) is not p:
        return None
    return root



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
    found: dict[int, tuple[weakref.ref[torch.nn.Module], str, weakref.ref[torch.nn.Module]]] = {}
    for m in modules:
        held = [(k, v) for k, v in (vars(m).get("_parameters") or {}).items() if v is not None]
        if not held:
            continue
        key = id(m)
        if key not in roots:
            root, seen = m, {id(m)}
            while id(root) in parent and id(parent[id(root)]) not in seen:  # (a cycle of modules ends the walk)
                root = parent[id(root)]
                seen.add(id(root))
            roots[key] = weakref.ref(root)
        holder = weakref.ref(m)
        for k, v in held:
            if identity(v) not in found:  # (a parameter two modules hold: the first one's root)
                found[identity(v)] = (holder, k, roots[key])
    _FOUND.clear()  # (what dead modules held goes too)
    _FOUND.update(found)
    _NO_MODULE.clear()  # as of this search: a parameter attached since is found again
    for q in parameters:
        if _found(q) is None:
            _NO_MODULE[identity(q)] = _tensor_key(q)
