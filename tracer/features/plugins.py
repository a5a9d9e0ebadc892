"""Which features a trace session composes in, from its options (``tracer.record.session`` imports
no feature; the layers above it, ``tracer.api`` and ``tracer.loops``, ask here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tracer.features.bounds import Bounds
from tracer.features.distributed import DistributedPlugin
from tracer.features.logs import attach_if_enabled
from tracer.features.memory import MemoryListener
from tracer.features.numerics import NonFiniteGuard
from tracer.features.values import KeepValues
from tracer.model import Trace
from tracer.options import TraceOptions
from tracer.record.listeners import Listener
from tracer.record.protocol import RecorderAPI
from tracer.record.session import SessionPlugin


class ListenerPlugin:
    """Attaches a listener made for the recorder (the NaN guard needs it; others ignore it)."""

    def __init__(self, make: Callable[[RecorderAPI], Listener]) -> None:
        self.make = make

    def prepare(self, session: Any, trace: Trace) -> None:
        pass

    def attach(self, recorder: RecorderAPI) -> Callable[[], None] | None:
        recorder.listeners.append(self.make(recorder))
        return None


class LogsPlugin:
    """GRADTRACE_LOG / ``set_log_level()`` levels log the whole trace."""

    def prepare(self, session: Any, trace: Trace) -> None:
        pass

    def attach(self, recorder: RecorderAPI) -> Callable[[], None] | None:
        attach_if_enabled(recorder)
        return None


def _bounds(max_bytes: int) -> Callable[[RecorderAPI], Listener]:
    def make(rec: RecorderAPI) -> Listener:
        bounds = Bounds(max_bytes=max_bytes)
        bounds.recorder = rec
        return bounds
    return make


def session_plugins(options: TraceOptions, *, bounds: bool = True) -> list[SessionPlugin]:
    """The features ``options`` ask for, in the order their listeners hear events: the size bound
    (``bounds``: the steps of a run bound themselves), memory records, the NaN guard, kept values, logs,
    then distributed runs (collectives)."""
    plugins: list[SessionPlugin] = []
    if bounds and options.max_bytes is not None:
        plugins.append(ListenerPlugin(_bounds(options.max_bytes)))
    if options.memory:
        plugins.append(ListenerPlugin(lambda rec: MemoryListener()))
    if options.raise_on_nonfinite:
        plugins.append(ListenerPlugin(NonFiniteGuard))
    if options.keeps_values:
        plugins.append(KeepValues(options))
    plugins += [LogsPlugin(), DistributedPlugin()]
    return plugins
