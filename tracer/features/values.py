"""Keeping the values of chosen tensors (``trace(keep_values=...)``), so that ``diff`` can give
element-wise differences where checksums and stats only say *that* a tensor changed.

``KeepValues`` is a session plugin. Attached, it stands in front of the recorder's hasher (the one
place every new tensor value passes through, named, at the moment it is recorded) and copies the
bytes of the tensors the patterns choose. Without ``keep_values`` it is not attached and nothing
here runs.

- **What is kept**: with ``keep_values=True`` every value of a parameter or buffer (its updates
  included); with patterns, every tensor value whose name, or the path of the module whose call
  made it, matches one of the ``fnmatch`` patterns (``"transformer.h.0.*"``, ``"lm_head.weight"``,
  ``"*@grad"``, ``"cross_entropy0:out"``). A module path is also tried with a dot after it, so
  ``"transformer.h.0.*"`` covers the calls of ``transformer.h.0`` itself as well as its submodules'.
- **When**: at record time, so an in-place change later in the block cannot alter the copy. A CPU
  tensor is copied at once; a CUDA tensor is copied into pinned host memory on its stream, without
  waiting, and read when the trace is flushed (no synchronisation on the training thread).
- **How much**: at most ``keep_values_bytes`` per trace (64 MiB by default), and no single value
  larger than a record line may hold. What a pattern chose but the trace did not keep is said in
  the trace's notes (how many, why, the first one's name), never dropped silently.
"""

from __future__ import annotations

import fnmatch
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from tracer.model import TensorRecord, Trace
from tracer.model.fileformat import MAX_RECORD_BYTES
from tracer.model.values import DTYPE_SIZES
from tracer.options import TraceOptions
from tracer.record.checksums.bytes import as_bytes, host_bytes, unhashable_reason
from tracer.record.own_work import own_work
from tracer.record.protocol import RecorderAPI
from tracer.record.transforms import is_wrapped, transforms_active

# The largest value one tensor record may carry: base64 grows it by a third, and the rest of the
# record needs a little room within the reader's line limit.
MAX_VALUE_BYTES = (MAX_RECORD_BYTES - (1 << 20)) // 4 * 3


def _size_text(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


class ValueKeeper:
    """Chooses tensor values by pattern and keeps copies of their bytes, within a byte budget."""

    def __init__(self, patterns: bool | tuple[str, ...], max_bytes: int,
                 current_module: Callable[[], str]) -> None:
        self.params_only = patterns is True
        globs = () if patterns is True or patterns is False else patterns
        self._match = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in globs)).match if globs else None
        self._module_hits: dict[str, bool] = {}
        self._current_module = current_module
        self.max_bytes = max_bytes
        self.used = 0
        self.kept = 0
        self._waiting: list[tuple[TensorRecord, torch.Tensor, Any]] = []  # (record, host copy, event)
        # why -> (how many, the first one's name): tensors chosen but not kept
        self.missed: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()  # node events arrive on autograd threads on CUDA

    # ---- choosing ---------------------------------------------------------------------------------
    def wants(self, rec: TensorRecord) -> bool:
        if self.params_only:
            return rec.role in ("param", "buffer")
        match = self._match
        if match is None:
            return False
        if match(rec.name):
            return True
        module = self._current_module()
        hit = self._module_hits.get(module)
        if hit is None:
            # ``P.``: ``transformer.h.0.*`` covers the block's own calls, not only its submodules'.
            hit = self._module_hits[module] = bool(module) and (match(module) or match(module + ".")) is not None
        return hit

    def _miss(self, why: str, name: str) -> None:
        n, first = self.missed.get(why, (0, name))
        self.missed[why] = (n + 1, first)

    # ---- copying ----------------------------------------------------------------------------------
    def offer(self, rec: TensorRecord, t: torch.Tensor) -> None:
        """Copy ``t``'s bytes for ``rec`` if the patterns choose it and the budget allows."""
        if rec.uninitialized or not self.wants(rec):
            return
        reason = unhashable_reason(t)
        if reason is None and (transforms_active() or is_wrapped(t)):
            reason = "inside a torch.func transform"
        if reason is None and rec.dtype not in DTYPE_SIZES:
            reason = f"dtype {rec.dtype}"
        if reason is None and sys.byteorder != "little":
            reason = "a big-endian host"
        if reason is not None:
            self._miss(f"not kept ({reason})", rec.name)
            return
        nbytes = t.numel() * t.element_size()
        with self._lock:
            if nbytes > MAX_VALUE_BYTES:
                self._miss(f"larger than one record may hold ({_size_text(MAX_VALUE_BYTES)})", rec.name)
                return
            if self.used + nbytes > self.max_bytes:
                self._miss(f"beyond the {_size_text(self.max_bytes)} cap (raise keep_values_bytes)", rec.name)
                return
            self.used += nbytes
            self.kept += 1
        with torch._C.DisableTorchFunction():
            b = as_bytes(t)
            if b.device.type == "cpu":
                rec.values = bytes(host_bytes(b))  # one copy, now: later writes cannot reach it
                return
            # On the tensor's stream, without waiting: a later write on that stream comes after
            # the copy; the bytes are read when the event says the copy is done.
            host = torch.empty(b.numel(), dtype=torch.uint8, device="cpu", pin_memory=True)
            host.copy_(b, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            self._waiting.append((rec, host, event))

    def finish(self, wait: bool) -> None:
        """Fill in the records whose copies are done (all of them if ``wait``)."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        still = []
        for rec, host, event in waiting:
            if wait:
                event.synchronize()
            elif not event.query():
                still.append((rec, host, event))
                continue
            rec.values = bytes(host_bytes(host))
        if still:
            with self._lock:
                self._waiting = still + self._waiting

    def pending(self) -> set[int]:
        with self._lock:
            return {id(rec) for rec, _, _ in self._waiting}

    def notes(self) -> list[str]:
        """What the trace's notes say: what was kept, and what was chosen but not kept."""
        what = "parameters and buffers" if self.params_only else "tensors matching keep_values"
        out = [f"values kept of {self.kept} {what} ({_size_text(self.used)} of {_size_text(self.max_bytes)})"]
        for why, (n, first) in self.missed.items():
            out.append(f"values of {n} {what} {why}; the first: {first}")
        return out


class KeepingHasher:
    """Stands in for the recorder's hasher: hands every tensor to it as before, and to the keeper."""

    def __init__(self, real: Any, keeper: ValueKeeper) -> None:
        self._real = real
        self._keeper = keeper

    @own_work  # no mode of the user's sees the keeper's copies either
    def submit(self, rec: TensorRecord, t: torch.Tensor) -> None:
        if self._real.active:
            self._real.submit(rec, t)
        self._keeper.offer(rec, t)

    def drain(self, wait: bool = False) -> None:
        self._real.drain(wait)
        self._keeper.finish(wait)

    def pending(self) -> set[int]:
        return set(self._real.pending()) | self._keeper.pending()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class KeepValues:
    """The session plugin: the header says what was asked for; attached, the keeper sees every
    new tensor value; detached, the copies still in flight are read and the notes written."""

    def __init__(self, options: TraceOptions) -> None:
        self.patterns = options.keep_values
        self.max_bytes = options.keep_values_bytes

    def prepare(self, session: Any, trace: Trace) -> None:
        patterns: Any = "params" if self.patterns is True else list(self.patterns or ())
        trace.header["keep_values"] = {"patterns": patterns, "max_bytes": self.max_bytes}

    def attach(self, recorder: RecorderAPI) -> Callable[[], None] | None:
        keeper = ValueKeeper(self.patterns, self.max_bytes, lambda: recorder.current_module)
        real = recorder.hasher
        recorder.hasher = KeepingHasher(real, keeper)  # type: ignore[assignment]

        def detach() -> None:
            keeper.finish(wait=True)
            if recorder.hasher is not real:
                recorder.hasher = real
            recorder.trace.notes.extend(keeper.notes())
        return detach


__all__ = ["MAX_VALUE_BYTES", "KeepValues", "KeepingHasher", "ValueKeeper"]
