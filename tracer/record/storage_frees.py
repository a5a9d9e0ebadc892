"""Storages resized inside a traced block: what the trace still has to read in them is read first.

FSDP (``fully_shard``) frees an unsharded parameter's memory once its layer has run, with
``untyped_storage().resize_(0)``, and gives it memory again before the layer's backward; no op
the recorder sees does either. Values waiting for their checksum in a batch (``hash="fast"``,
``check_numerics`` on CUDA) are held as tensors, but a resize frees the memory under them
whatever holds them: the caching allocator then hands those bytes to the next allocation, and
the batch would read whatever that wrote. So while a trace is on, ``UntypedStorage.resize_`` is
wrapped: the bytes the storage holds are read first (``Hasher.before_free``). A storage given
memory again (resized from nothing) holds whatever the allocator left there until something
writes it: a tensor in it seen before that is recorded as uninitialised memory, not hashed
(``TensorNames.fresh_storage``), as ``torch.empty``'s output is.
"""

from __future__ import annotations

from typing import Any

import torch

from tracer.record.functions import active_recorder
from tracer.record.mode import on_traced_thread

# A method of torch's C storage base unless a torch release defines it on the class itself.
_OWN = "resize_" in torch.UntypedStorage.__dict__
_REAL_RESIZE: Any = torch.UntypedStorage.resize_


def _traced_resize(self: torch.UntypedStorage, size: int) -> Any:
    rec = active_recorder()
    if rec is None or rec.closed or rec.stopped or not on_traced_thread(rec):
        return _REAL_RESIZE(self, size)
    empty = False
    try:
        empty = self.nbytes() == 0
        rec.hasher.before_free(self)  # (gradtrace's own work: torch functions off in there)
    except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
        rec.recorder_failed(exc)
    result = _REAL_RESIZE(self, size)
    if empty and size and not rec.stopped:
        try:  # memory given back: its bytes are whatever the allocator left there
            with rec.lock:
                rec.names.fresh_storage(int(self.data_ptr()), int(self.data_ptr()) + int(self.nbytes()))
        except Exception as exc:
            rec.recorder_failed(exc)
    return result


def install_resize_wrapper() -> None:
    torch.UntypedStorage.resize_ = _traced_resize  # type: ignore[method-assign,assignment]


def uninstall_resize_wrapper() -> None:
    if _OWN:
        torch.UntypedStorage.resize_ = _REAL_RESIZE  # type: ignore[method-assign]
    elif "resize_" in torch.UntypedStorage.__dict__:
        del torch.UntypedStorage.resize_
