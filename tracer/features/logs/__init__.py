"""Scoped logs: log the forward calls of one block of code and, later, the grad nodes it created.

Standard Python ``logging`` under the ``gradtrace`` logger, one child logger per component
(``gradtrace.forward``, ``gradtrace.backward``, ``gradtrace.memory``), so handlers, files and
filters work as usual::

    import tracer
    tracer.set_log_level("INFO")                                   # every component
    tracer.set_log_level({"forward": "DEBUG", "backward": "INFO", "*": "WARNING"})
    tracer.get_log_level()            # {'*': 'WARNING', 'forward': 'DEBUG', 'backward': 'INFO', ...}

    with tracer.log_scope(level="DEBUG"):        # log this block only
        h = model.block2(h)
    loss.backward()      # the grad nodes made in the block log now, nothing else does

Levels of detail (one line per call or node event; the logger's level picks the detail, and the
record is emitted at that level, so a handler's own level filters the same way):

=========  =====  ===========================================================================
level      value  what a line shows
=========  =====  ===========================================================================
INFO       20     names only: call name, API, module path; grad node begin/end
DEBUG      10     + input/output (received/produced gradient) names, shapes, dtypes and a
                  short checksum where the trace hashes (``md5:1a2b3c4d``)
STATS      7      + min/max/mean/absmax of every output or gradient, NaN/Inf counts
VALUES     5      + the values of tensors with at most ``VALUES_MAX_NUMEL`` elements
=========  =====  ===========================================================================

``names`` and ``shapes`` are accepted as aliases of INFO and DEBUG. STATS and VALUES read the
tensors: on a GPU each such line waits for the device once (the price of that detail).

Where lines come from:

- Inside ``tracer.trace()``: the trace's recorder calls a listener (``tracer.record.listeners``). Global
  levels (``set_log_level``, ``GRADTRACE_LOG``) log every traced call and grad node at those
  levels; a ``log_scope`` logs the calls of its block, and the grad nodes its calls created when
  they run, for as long as the trace lasts. ``trace()`` must enclose ``log_scope``, not the other
  way round.
- Without a trace, ``log_scope`` records its block with a light recorder of its own (no hashing,
  no stacks) that is removed when the block ends. To log the backward that usually runs after
  the block, it puts a pre-hook and a hook on each grad node created in the block; those hooks
  hold only names and live as long as the graph (``LogScope.close()`` removes them earlier).
  Names then count from the start of the block, and parameters are named relative to the first
  module entered in it.

Leaf accumulators (``<param>/AccumulateGrad``) are followed with the nodes of a block when they
were first reached from them; inside a trace, also only when no node outside the block reaches
them (without a trace, what happens outside the block cannot be seen).

The ``gradtrace`` logger gets a console handler (aligned columns, colour on a terminal, plain
text otherwise, indentation by module depth and custom-Function nesting) and does not propagate
to the root logger; ``configure_console(False)`` removes it and lets records propagate. Its level
defaults to WARNING, so configuring the root logger for DEBUG does not switch per-call logs on.

``GRADTRACE_LOG=forward=DEBUG,backward=INFO`` (or ``GRADTRACE_LOG=DEBUG``) sets levels when this
module is imported, without code changes.
"""

from __future__ import annotations

import logging

from tracer.features.logs.console import ConsoleHandler, configure_console
from tracer.features.logs.levels import (
    COMPONENTS,
    ROOT,
    STATS,
    VALUES,
    VALUES_MAX_NUMEL,
    get_log_level,
    parse_env,
    parse_level,
)
from tracer.features.logs.lines import LogLine
from tracer.features.logs.scope import LogScope, apply_env, attach_if_enabled, log_scope, set_log_level


def _init() -> None:
    lg = logging.getLogger(ROOT)
    if lg.level == logging.NOTSET:
        lg.setLevel(logging.WARNING)
    if not any(isinstance(h, ConsoleHandler) for h in lg.handlers):
        configure_console(True)
    apply_env()


_init()

__all__ = ["COMPONENTS", "STATS", "VALUES", "VALUES_MAX_NUMEL", "ConsoleHandler", "LogLine", "LogScope",
           "apply_env", "attach_if_enabled", "configure_console", "get_log_level", "log_scope", "parse_env",
           "parse_level", "set_log_level"]
