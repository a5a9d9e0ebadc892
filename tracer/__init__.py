"""gradtrace's recording side: ``tracer.trace()`` around a training step, ``tracer.load()``.

    import tracer
    with tracer.trace() as t:
        loss = model(x).loss
        loss.backward()
    t.save("step.gtrace")
    print(t["linear3"].stack[-1])
"""

from __future__ import annotations

from tracer.logs import get_log_level, log_scope, set_log_level
from tracer.memory import MemoryRecord, memory_summary, record_memory
from tracer.model import (
    SCHEMA_VERSION,
    BackwardRun,
    Call,
    Frame,
    GradNode,
    NodeRun,
    Stats,
    TensorRecord,
    Trace,
    TraceFormatError,
    TruncatedTraceWarning,
    load,
)
from tracer.numerics import NonFiniteError, NumericsReport
from tracer.record.checksums.bytes import md5_of
from tracer.record.session import (
    NumericsWarning,
    TraceError,
    __version__,
    check_numerics,
    explain_errors,
    trace,
)
from tracer.steps import step

__all__ = [
    "SCHEMA_VERSION",
    "BackwardRun",
    "Call",
    "Frame",
    "GradNode",
    "MemoryRecord",
    "NodeRun",
    "NonFiniteError",
    "NumericsReport",
    "NumericsWarning",
    "Stats",
    "TensorRecord",
    "Trace",
    "TraceError",
    "TraceFormatError",
    "TruncatedTraceWarning",
    "__version__",
    "check_numerics",
    "explain_errors",
    "get_log_level",
    "load",
    "log_scope",
    "md5_of",
    "memory_summary",
    "record_memory",
    "set_log_level",
    "step",
    "trace",
]
