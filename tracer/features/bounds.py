"""``max_calls`` / ``max_bytes``: stop recording cleanly once a trace is big enough."""

from __future__ import annotations

from typing import Any

from tracer.model import Trace
from tracer.record import recorder as _recorder
from tracer.record.listeners import Listener
from tracer.record.protocol import RecorderAPI


class Bounds(Listener):
    """Stops recording once a trace (plus ``*_before``, what earlier steps used) reaches a bound.

    ``max_bytes`` bounds the size of the trace's records. Counting exact JSON bytes per call
    would cost a serialisation per call, so the size is estimated from record counts times the
    average size of each record kind (measured on GPT-2 traces, with md5 and stats, which
    dominate); a streamed step's real file size replaces the estimate once the step is written.
    Usable on its own: ``tracer.trace(listeners=[Bounds(max_bytes=50_000_000)])``.
    """

    CALL_BYTES = 310
    TENSOR_BYTES = 400
    NODE_BYTES = 210
    NODE_RUN_BYTES = 120
    needs_node_runs = False  # it counts the runs recorded, and asks for none

    def __init__(self, max_calls: int | None = None, max_bytes: int | None = None, *,
                 calls_before: int = 0, bytes_before: int = 0) -> None:
        self.max_calls = max_calls
        self.max_bytes = max_bytes
        self.calls_before = calls_before
        self.bytes_before = bytes_before
        self.recorder: RecorderAPI | None = None
        self.tripped: str | None = None
        self._node_runs = 0

    def estimate(self, trace: Trace) -> int:
        """Estimated bytes of the trace's records so far."""
        return (len(trace.calls) * self.CALL_BYTES + len(trace.tensors) * self.TENSOR_BYTES
                + len(trace.grad_nodes) * self.NODE_BYTES + self._node_runs * self.NODE_RUN_BYTES)

    def on_call(self, trace: Trace, call: Any, token: Any, outputs: list[Any]) -> None:
        if self.tripped is not None:
            return
        if self.max_calls is not None and self.calls_before + len(trace.calls) >= self.max_calls:
            earlier = f" ({self.calls_before} in earlier steps)" if self.calls_before else ""
            self._stop(f"recording stopped at max_calls={self.max_calls}{earlier}: later calls, grad nodes "
                       "and backward runs were not recorded")
        else:
            self._check_bytes(trace)

    def on_node_end(self, trace: Trace, node: str, step: Any, grads: tuple[Any, ...]) -> None:
        self._node_runs += 1
        if self.tripped is None:
            self._check_bytes(trace)

    def _check_bytes(self, trace: Trace) -> None:
        if self.max_bytes is not None and self.bytes_before + self.estimate(trace) >= self.max_bytes:
            earlier = f" ({self.bytes_before} in earlier steps)" if self.bytes_before else ""
            self._stop(f"recording stopped at max_bytes={self.max_bytes}{earlier}, estimated size of the "
                       "trace's records: later calls, grad nodes and backward runs were not recorded")

    def _stop(self, reason: str) -> None:
        rec = self.recorder or _recorder.active_recorder()
        self.tripped = reason
        if rec is not None:
            rec.stop(reason)


# ---- one step's trace ----------------------------------------------------------------------------
