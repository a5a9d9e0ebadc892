"""The trace data model, the layer everything else stands on: plain records, the ``Trace`` that
links them by name, the name grammar, and the file format (reading and streaming). Pure data:
nothing here imports torch, so a trace loads and renders without it."""

from tracer.model.fileformat import StepInfo, TruncatedTraceWarning, load, load_steps, read_trace
from tracer.model.records import (
    FORMAT,
    SCHEMA_VERSION,
    BackwardRun,
    Call,
    Frame,
    GradNode,
    MemoryEvent,
    NodeRun,
    Record,
    Sharding,
    Stats,
    TensorRecord,
    TraceFormatError,
)
from tracer.model.trace import Trace, install_view
from tracer.model.writer import StreamWriter, TraceStream, write_trace

__all__ = [
    "FORMAT",
    "SCHEMA_VERSION",
    "BackwardRun",
    "Call",
    "Frame",
    "GradNode",
    "MemoryEvent",
    "NodeRun",
    "Record",
    "Sharding",
    "Stats",
    "StepInfo",
    "StreamWriter",
    "TensorRecord",
    "Trace",
    "TraceFormatError",
    "TraceStream",
    "TruncatedTraceWarning",
    "install_view",
    "load",
    "load_steps",
    "read_trace",
    "write_trace",
]
