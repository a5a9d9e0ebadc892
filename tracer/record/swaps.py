"""``torch.utils.swap_tensors`` inside a traced block.

``swap_tensors(t1, t2)`` exchanges what two tensor objects hold while each keeps its identity:
``Module.to``/``.half()`` with ``torch.__future__.set_swap_module_params_on_conversion(True)``,
``load_state_dict`` the same way, FSDP2's set-up, parametrizations. It refuses a tensor that has
a weak reference, and the recorder keeps weak references to the tensors it names (never
strong ones: a trace holds no tensor). So while a trace is on, swap_tensors is wrapped: the
recorder takes its references to the two tensors off, the swap runs, and they are put back,
each following what it describes. A name follows the value (the bytes and the version counter
moved with it); a parameter's, buffer's, state's or ``.grad``'s path stays with its object,
which then shows a new version of itself holding the swapped-in value (``0.weight@v1``,
``0.weight@grad@v1``: its checksum the value's, ``previous`` what the object held before).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.utils

from tracer.model.names import base_name
from tracer.model.records import OWNED_ROLES
from tracer.record.functions import active_recorder
from tracer.record.part import Part
from tracer.record.tensor_names import Held

_REAL_SWAP: Callable[[torch.Tensor, torch.Tensor], None] = torch.utils.swap_tensors
# Objects whose name is their place (a path, a parameter's .grad), not the value they hold.
_PLACED_ROLES = OWNED_ROLES | {"grad"}


def _traced_swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
    rec = active_recorder()
    if rec is None or rec.closed or not (weakref.getweakrefs(t1) or weakref.getweakrefs(t2)):
        return _REAL_SWAP(t1, t2)
    rec.swaps.record_swap(_REAL_SWAP, t1, t2)


def install_swap_wrapper() -> None:
    torch.utils.swap_tensors = _traced_swap


def uninstall_swap_wrapper() -> None:
    torch.utils.swap_tensors = _REAL_SWAP


class Swaps(Part):
    """``torch.utils.swap_tensors`` of tensors the trace knows (a part of ``Recorder``)."""

    def record_swap(self, swap: Callable[[torch.Tensor, torch.Tensor], None], t1: torch.Tensor,
                    t2: torch.Tensor) -> None:
        rec = self.rec
        try:
            with rec.lock, torch._C.DisableTorchFunction():
                rec.hasher.before_write()  # values waiting for their checksum are read first
                held = (self._release(t1), self._release(t2))
        except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
            rec.recorder_failed(exc)
            swap(t1, t2)
            return
        swapped = False
        try:
            swap(t1, t2)
            swapped = True
        finally:
            try:
                with rec.lock, torch._C.DisableTorchFunction():
                    self._after_swap(t1, t2, held, swapped)
            except Exception as exc:
                rec.recorder_failed(exc)

    def _release(self, t: torch.Tensor) -> Held:
        """Take every weak reference of the recorder to ``t`` off, keeping what its names said
        (the graph's references, an accumulator's leaf among them, are dropped: a new
        accumulator follows, swap_tensors poisons the one it had)."""
        held = self.rec.names.take_off(t)
        self.rec.graph.forget_tensor(t)
        return held

    def _after_swap(self, t1: torch.Tensor, t2: torch.Tensor, held: tuple[Held, Held], swapped: bool) -> None:
        """Put the references back: names with the values they name (exchanged when the swap
        ran), paths with their objects, each owned object a new version of its path."""
        names = self.rec.names
        tensors = self.rec.trace.tensors
        pairs = ((t1, held[0], held[1]), (t2, held[1], held[0])) if swapped else \
            ((t1, held[0], held[0]), (t2, held[1], held[1]))
        for t, own, value in pairs:
            names.put_back(t, own, value)
        if not swapped:
            return
        for t, own, value in pairs:
            if own.name is None:
                continue
            before = tensors.get(own.name[0])
            role = own.owned[1] if own.owned is not None else before.role if before is not None else None
            if role not in _PLACED_ROLES:
                continue
            shown = tensors.get(value.name[0]) if value.name is not None else None
            names.new_tensor(t, names.bump(base_name(own.name[0])), role,
                             shown.producer if shown is not None else None, previous=own.name[0], same_as=shown)
