"""gradtrace's recording side: ``tracer.trace()`` around a training step, ``tracer.load()``.

    import tracer
    with tracer.trace() as t:
        loss = model(x).loss
        loss.backward()
    t.save("step.gtrace")
    print(t["linear3"].stack[-1])

The data model and its analyses (``load``, ``Trace``, the records, ``t.anomalies``) import
without torch, so a saved trace can be read anywhere; the names that record (``trace`` and the
rest) import torch on first use.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from tracer.analysis.memory import MemoryRecord
from tracer.analysis.numerics import Anomaly, NonFiniteError, NumericsReport
from tracer.companion import ExportShadowedWarning, warn_if_export_is_shadowed
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
    load_steps,
)
from tracer.options import TraceError, TraceKwargs, TraceOptions
from tracer.version import __version__

# gradtrace's tracer, not another module of that name (a user's tracer.py, a PyPI "tracer"):
# export checks it when it imports tracer, ``python -m tracer`` and the command line check export's.
__gradtrace__ = "tracer"
# And the other way round: a program whose own export.py hides gradtrace's export is told so here,
# naming both files, rather than meeting "module 'export' has no attribute 'html'" later.
warn_if_export_is_shadowed()

if TYPE_CHECKING:  # the names resolved on first use, below
    from tracer.analysis.determinism import DeterminismReport
    from tracer.api import check_numerics, explain_errors, record_memory, step, trace
    from tracer.features.determinism import check_determinism
    from tracer.features.logs import get_log_level, log_scope, set_log_level
    from tracer.features.memory import memory_summary
    from tracer.features.steplog import StepLog, step_log
    from tracer.features.watch import Incident, Spike, WatchTripped, watch
    from tracer.loops.steps import StepTrace
    from tracer.record.checksums.bytes import md5_of
    from tracer.record.listeners import Listener
    from tracer.record.session import NumericsWarning, TraceSession

# Names that import torch: resolved on first access (PEP 562).
_LAZY = {
    "trace": "tracer.api", "check_numerics": "tracer.api", "explain_errors": "tracer.api",
    "record_memory": "tracer.api", "step": "tracer.api",
    "memory_summary": "tracer.features.memory",
    "get_log_level": "tracer.features.logs", "log_scope": "tracer.features.logs",
    "set_log_level": "tracer.features.logs",
    "md5_of": "tracer.record.checksums.bytes",
    "watch": "tracer.features.watch", "Spike": "tracer.features.watch", "WatchTripped": "tracer.features.watch",
    "Incident": "tracer.features.watch",
    "StepTrace": "tracer.loops.steps",
    "step_log": "tracer.features.steplog", "StepLog": "tracer.features.steplog",
    "check_determinism": "tracer.features.determinism", "DeterminismReport": "tracer.analysis.determinism",
    "Listener": "tracer.record.listeners",
    "NumericsWarning": "tracer.record.session", "TraceSession": "tracer.record.session",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tracer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "SCHEMA_VERSION",
    "Anomaly",
    "BackwardRun",
    "Call",
    "DeterminismReport",
    "ExportShadowedWarning",
    "Frame",
    "GradNode",
    "Incident",
    "Listener",
    "MemoryRecord",
    "NodeRun",
    "NonFiniteError",
    "NumericsReport",
    "NumericsWarning",
    "Spike",
    "Stats",
    "StepLog",
    "StepTrace",
    "TensorRecord",
    "Trace",
    "TraceError",
    "TraceFormatError",
    "TraceKwargs",
    "TraceOptions",
    "TraceSession",
    "TruncatedTraceWarning",
    "WatchTripped",
    "__version__",
    "check_determinism",
    "check_numerics",
    "explain_errors",
    "get_log_level",
    "load",
    "load_steps",
    "log_scope",
    "md5_of",
    "memory_summary",
    "record_memory",
    "set_log_level",
    "step",
    "step_log",
    "trace",
    "watch",
]

# torch imported already (a training script imports it first): the recording side loads now
# rather than inside the first traced step (~0.1 s of imports), and with it Triton's own
# start-up (tracer.record.checksums.prewarm: ~0.9 s, only with a CUDA or ROCm build and Triton).
if "torch" in sys.modules:
    import tracer.api  # noqa: F401
