"""The model a parameter belongs to, for a parameter the trace meets before any module of its
model has been called (weight clipping before the critic's forward, an EMA update or an
initialisation first in the block, a block that starts with ``optimizer.step()``).

Parameters are named by the module tree they are registered in, which the recorder learns when
a module is called. A parameter met earlier would be named ``input<k>`` for the whole trace
(its gradient ``input<k>@grad``, the optimizer's reads ``input<k>@v1``). So the recorder asks
here for the outermost module that holds it, among the live objects (one ``gc.get_objects()``
pass: tens of milliseconds in a large process, paid only in this case, a few times per trace
at most), and names that module's tree then, as if it had been called first.
"""

from __future__ import annotations

import gc
import sys
import weakref
from types import FrameType

import torch

from tracer.record.weakmap import IdWeakMap

# Parameter -> its root module, from earlier searches: a loop that traces every step and meets
# a parameter first each time (weight clipping at the top of the step) searches once. By
# identity (a tensor's == compares values).
_FOUND: IdWeakMap[weakref.ref[torch.nn.Module]] = IdWeakMap()


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


def owning_root_module(p: torch.Tensor) -> torch.nn.Module | None:
    """The outermost ``nn.Module`` that holds ``p`` as a parameter (following ``_modules`` up
    from the module that registers it), or None when no live module does."""
    ref = _FOUND.get(p)
    root = ref() if ref is not None else None
    if root is not None:
        return root
    root = _search(p)
    if root is not None:
        held = weakref.ref(root)
        for q in root.parameters():
            _FOUND[q] = held
    return root


def _search(p: torch.Tensor) -> torch.nn.Module | None:
    # type(), not isinstance(): isinstance reads __class__, which some module-level objects
    # answer with a deprecation warning (torch.distributed.reduce_op).
    module_type = torch.nn.Module
    modules = [o for o in gc.get_objects() if issubclass(type(o), module_type)]
    parent: dict[int, torch.nn.Module] = {}
    owner: torch.nn.Module | None = None
    for m in modules:
        for child in m._modules.values():
            if child is not None and id(child) not in parent and child is not m:
                parent[id(child)] = m
        if owner is None and any(v is p for v in m._parameters.values()):
            owner = m
    if owner is None:
        return None
    root, seen = owner, {id(owner)}
    while id(root) in parent and id(parent[id(root)]) not in seen:  # (a cycle of modules ends the walk)
        root = parent[id(root)]
        seen.add(id(root))
    return root
