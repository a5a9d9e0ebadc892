"""What an op does besides returning its outputs: the arguments it writes, the outputs it leaves
uninitialised.

Version counters do not tell every write. ``torch._fused_adamw_`` (fused Adam/AdamW/SGD) and
``torch._amp_foreach_non_finite_check_and_unscale_`` (``GradScaler``'s unscale) change their
arguments without bumping ``_version``; batch norm updates its running statistics inside the
kernel. So the arguments an op writes are taken from its ATen schema (an argument typed
``Tensor(a!)`` or ``Tensor(a!)[]`` is written), from PyTorch's in-place naming convention, and
from a short list of ops whose schema does not say so. Looked up once per function object.

``torch.empty`` and its kin return memory nobody wrote: hashing it would make two identical runs
differ, and its stats are noise. Their outputs are recorded as uninitialised; the first write
into one is a new version, hashed as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tracer.model.phases import replaces_whole

# Tensor-returning ops whose result holds uninitialised memory (by their short name).
UNINITIALISED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                           "empty_permuted"})
# In-place resizes: a tensor they grow holds uninitialised memory past its old elements (by API;
# torch.ao's per-channel observers grow their empty min/max buffers this way).
RESIZING_APIS = frozenset({"Tensor.resize_", "Tensor.resize_as_", "torch.resize_as_"})
# Writes that replace all of what they write besides the initialisers, fills and copy_
# (tracer.model.phases.replaces_whole), by short name: a new storage, a copy of whole lists, the
# collectives whose output is all received. What else writes into uninitialised memory leaves
# the rest of it as it was (see TensorNames._still_uninitialised).
_WHOLE_WRITERS = frozenset({"set_", "_foreach_copy_", "broadcast", "recv", "irecv", "all_gather", "all_gather_coalesced",
                            "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
                            "all_gather_into_tensor_coalesced", "all_gather_single_coalesced", "reduce_scatter",
                            "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
                            "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "all_to_all_single",
                            "all_to_all", "permute_tensor"})


def writes_whole(api: str) -> bool:
    """Whether the call ``api`` writes every byte of the tensors it writes (``out=`` aside)."""
    short = api.rpartition(".")[2]
    return short in _WHOLE_WRITERS or replaces_whole(api)

_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__ilshift__", "__irshift__", "__iand__", "__ior__",
                              "__ixor__", "__imatmul__"})


@dataclass(frozen=True, slots=True)
class Writes:
    """The arguments an op writes: positional ``positions`` and keyword ``names``; ``when``, if
    set, says whether a given call writes at all (batch norm only in training)."""

    positions: tuple[int, ...]
    names: frozenset[str] = frozenset()
    when: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None
    # Positions only a list of tensors is written at (``aten::sort.Tensor(Tensor[](a!) self)``, a
    # TorchScript list sort beside the tensor sort): a tensor passed there is only read.
    lists_only: frozenset[int] = frozenset()

    def tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensors this call writes into."""
        out: list[torch.Tensor] = []
        if self.when is not None and not self.when(args, kwargs):
            return out
        for i in self.positions:
            if i < len(args) and not (i in self.lists_only and isinstance(args[i], torch.Tensor)):
                _collect(args[i], out)
        if kwargs:
            for k in self.names:
                if k in kwargs:
                    _collect(kwargs[k], out)
        return out


def _collect(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, list | tuple):
        out.extend(v for v in value if isinstance(v, torch.Tensor))


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


# The API name of an assignment to ``Tensor.data`` (``t.data = v``: ``t`` gets v's bytes while its
# version counter stays): a call that writes ``t`` and no tensor sharing t's old bytes.
SET_DATA_API = "Tensor.data="

# Ops that update running statistics without their schema saying so (Python-level signatures:
# the positions of running_mean/running_var and of the flag that makes them update).
_HIDDEN: dict[str, Writes] = {
    "torch.nn.functional.batch_norm": Writes((1, 2), frozenset({"running_mean", "running_var"}),
                                             lambda a, k: bool(_arg(a, k, 5, "training", False))),
    "torch.batch_norm": Writes((3, 4), frozenset({"running_mean", "running_var"}),
                               lambda a, k: bool(_arg(a, k, 5, "training", False))),
    "torch.native_batch_norm": Writes((3, 4), frozenset({"running_mean", "running_var"}),
                                      lambda a, k: bool(_arg(a, k, 5, "training", False))),
    "torch.nn.functional.instance_norm": Writes((1, 2), frozenset({"running_mean", "running_var"}),
                                                lambda a, k: bool(_arg(a, k, 5, "use_input_stats", True))),
    "torch.instance_norm": Writes((3, 4), frozenset({"running_mean", "running_var"}),
                                  lambda a, k: bool(_arg(a, k, 5, "use_input_stats", True))),
    SET_DATA_API: Writes((0,)),
}


# In-place ops whose schema marks ``self`` written but which change neither its bytes nor its
# shape (``detach_`` cuts the tensor from autograd): no new version.
_METADATA_ONLY = frozenset({"detach_"})


def op_writes(func: Any, api: str) -> Writes | None:
    """The arguments ``func`` (seen by the recorder as ``api``) may write, or None."""
    hidden = _HIDDEN.get(api)
    if hidden is not None:
        return hidden
    short = api.rsplit(".", 1)[-1]
    if short in _METADATA_ONLY:
        return None
    schemas = _schemas(func, api)
    positions: set[int] = set()
    tensor_positions: set[int] = set()
    names: set[str] = set()
    for schema in schemas:
        for i, a in enumerate(schema.arguments):
            info = a.alias_info
            if info is None or not info.is_write:
                continue
            # Only tensors and lists of them: an overload name also has TorchScript builtins
            # that write a Python list, a dict or a Generator (``sort.int(int[](a!) self)``,
            # ``manual_seed(Generator(a!) self)``), none of which a tensor call writes.
            kind = _written_kind(a.type)
            if kind is None:
                continue
            names.add(a.name)
            if not a.kwarg_only:
                positions.add(i)
                if kind == "tensor":
                    tensor_positions.add(i)
    if not positions and not names and api.startswith("Tensor.") and (
            short in _INPLACE_DUNDERS or (short.endswith("_") and not short.startswith("__"))):
        positions.add(0)  # an in-place method without a schema of its own: it writes self
        tensor_positions.add(0)
    if not positions and not names:
        return None
    return Writes(tuple(sorted(positions)), frozenset(names), lists_only=frozenset(positions - tensor_positions))


def _written_kind(ty: Any) -> str | None:
    """``"tensor"`` for a ``Tensor`` or ``Tensor?`` argument, ``"list"`` for a list of them,
    None for anything else (schema types: ``torch._C.JitType``)."""
    kind = ty.kind()
    if kind == "OptionalType":
        return _written_kind(ty.getElementType())
    if kind == "TensorType":
        return "tensor"
    if kind == "ListType" and _written_kind(ty.getElementType()) == "tensor":
        return "list"
    return None


def _schemas(func: Any, api: str) -> list[Any]:
    """ATen schemas of the op behind ``func`` (every overload of its name), or none."""
    if isinstance(func, torch._ops.OpOverload):
        return [func._schema]
    packet = func if isinstance(func, torch._ops.OpOverloadPacket) else None
    if packet is None:
        if api.startswith("Tensor."):
            attr = api[len("Tensor."):]
        elif api.startswith("torch.") and api.count(".") == 1:
            attr = api[len("torch."):]
        else:
            return []
        if attr.startswith("__"):
            return []
        try:
            packet = getattr(torch.ops.aten, attr)
        except (AttributeError, RuntimeError):
            return []
    out = []
    try:
        for overload in packet.overloads():
            out.append(getattr(packet, overload)._schema)
    except (AttributeError, RuntimeError):
        return []
    return out
