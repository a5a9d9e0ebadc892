"""Tensors that arrive from another process: a DataLoader worker's batch, anything sent through
``torch.multiprocessing`` (a queue, a pipe, a spawned process's result).

torch sends a tensor to another process as a handle to shared memory, and the receiving process
rebuilds it while unpickling (``Queue.get``) with the ``rebuild_*`` functions of
``torch.multiprocessing.reductions``, one per kind (a CPU storage by file descriptor or file
name, CUDA IPC, typed storages, nested, sparse and meta tensors, events), which pickle finds by
name when it loads. Under the recorder's mode that rebuilding was recorded as calls of the step
(``torch.empty``, then ``set_`` onto the shared storage) holding whatever the empty tensor's
memory held, as many and in an order that depend on when each worker's batch came in: identical
runs diffed DIVERGED. While a trace is on, each of those functions is wrapped (the module's
attribute, where pickle looks it up) and runs with recording paused on the tracing thread: what
it returns is a tensor from outside the block, named like one (``input<k>``) when a call first
reads it.

Why these functions: they are the one place where every tensor torch sends between processes is
rebuilt, whatever carried it and whatever its kind, and nothing else runs through them. A
DataLoader's ``__next__`` would be narrower (only DataLoader workers) and wider at once (without
workers it runs the dataset and the collate in this process: the program's own calls, recorded
as before); telling the rebuilt tensors' calls apart by their caller would cost a frame walk per
call. The wrappers keep the functions' module and name (``functools.wraps``): a worker forked
while a trace is on pickles a tensor by a reference to them, which must resolve to the same
object there.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch.multiprocessing.reductions as reductions

from tracer.record.functions import active_recorder

_REBUILDERS: dict[str, Callable[..., Any]] = {
    name: fn for name, fn in vars(reductions).items() if name.startswith("rebuild_") and callable(fn)}


def _unrecorded(rebuild: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(rebuild)
    def rebuild_unrecorded(*args: Any, **kwargs: Any) -> Any:
        rec = active_recorder()
        if rec is None or rec.closed or rec.paused or threading.get_ident() != rec.owner:
            return rebuild(*args, **kwargs)
        rec.paused = True
        try:
            return rebuild(*args, **kwargs)
        finally:
            rec.paused = False

    return rebuild_unrecorded


_WRAPPED = {name: _unrecorded(fn) for name, fn in _REBUILDERS.items()}


def install_rebuild_wrappers() -> None:
    for name, wrapper in _WRAPPED.items():
        setattr(reductions, name, wrapper)


def uninstall_rebuild_wrappers() -> None:
    for name, original in _REBUILDERS.items():
        if getattr(reductions, name, None) is _WRAPPED[name]:
            setattr(reductions, name, original)
