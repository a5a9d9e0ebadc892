"""A distributed tensor's local shard and layout, for the hasher: ``DTensor`` (``torch.distributed.tensor``)
is a tensor subclass whose bytes live in one plain local tensor per rank. The trace hashes that
local shard and records the layout beside it (``tracer.model.Sharding``), so that ``diff --ranks``
knows which ranks must hold equal bytes (those that differ only along ``Replicate()`` dimensions).

Only public API is used (``DTensor.to_local()``, ``placements``, ``device_mesh``). The module is
looked up, not imported: importing ``torch.distributed.tensor`` takes seconds, and a DTensor can
only exist in a process that has imported it already (a torch without it has none to meet).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from tracer.model import Sharding

_MODULE = "torch.distributed.tensor"


def placement_text(p: Any, api: Any) -> str:
    """``Shard(0)``, ``Replicate()``, ``Partial(sum)``; other placements as torch prints them."""
    if type(p) is getattr(api, "Shard", None):
        return f"Shard({p.dim})"
    if isinstance(p, getattr(api, "Replicate", ())):
        return "Replicate()"
    if isinstance(p, getattr(api, "Partial", ())):
        return f"Partial({getattr(p, 'reduce_op', '?')})"
    return repr(p)  # _StridedShard and newer kinds: never read as Replicate by the comparison


# Per device mesh (by identity): its dimension names, shape, global ranks and this rank's
# coordinate. Reading ``mesh.mesh`` costs ~150 µs (torch 2.13 builds it), and a tensor-parallel
# step meets the same few meshes on thousands of DTensors.
_MESHES: dict[int, tuple[weakref.ref[Any], tuple[Any, ...]]] = {}


def _mesh_layout(mesh: Any) -> tuple[Any, ...]:
    hit = _MESHES.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    coordinate = mesh.get_coordinate()
    layout = (tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else (None,) * mesh.ndim, tuple(mesh.shape),
              tuple(mesh.mesh.flatten().tolist()), None if coordinate is None else tuple(coordinate))
    if len(_MESHES) > 64:  # meshes come and go (tests, restarts): keep the table small
        _MESHES.clear()
    try:
        _MESHES[id(mesh)] = (weakref.ref(mesh), layout)
    except TypeError:  # a mesh type without weak references: not cached
        pass
    return layout


def local_shard(t: torch.Tensor) -> tuple[torch.Tensor, Sharding] | None:
    """A DTensor's local shard (a plain tensor, or whatever it wraps) and its layout; None for
    anything else. Nothing here is recorded as a call: the mode is off and autograd too."""
    api = sys.modules.get(_MODULE)
    dtensor = getattr(api, "DTensor", None)
    if dtensor is None or not isinstance(t, dtensor):
        return None
    with torch._C.DisableTorchFunction(), torch.no_grad():
        local = t.to_local()
        dims, shape, ranks, coordinate = _mesh_layout(t.device_mesh)
        sharding = Sharding(placements=tuple(placement_text(p, api) for p in t.placements), mesh_dims=dims,
                            mesh_shape=shape, mesh_ranks=ranks, coordinate=coordinate, local_shape=tuple(local.shape))
    return local, sharding
