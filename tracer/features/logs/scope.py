"""Scopes: ``log_scope`` logs one block's forward calls and, later, the grad nodes the block
created; inside a trace through the trace's recorder, else with a light recorder of its own.
``set_log_level``/``GRADTRACE_LOG`` levels log the whole of a trace."""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch

from tracer.features.logs.levels import (
    BACKWARD,
    ENV_VAR,
    FORWARD,
    LevelSpec,
    detail_of,
    logger_of,
    parse_env,
    parse_level,
    pop_levels,
    push_levels,
    set_levels,
    user_level,
)
from tracer.features.logs.lines import Follow, api_label, call_line, emit, emit_node, internal_error
from tracer.features.logs.torch_logs import TorchLogs
from tracer.model import Call, GradNode, NodeRun, Trace
from tracer.model.display import module_depth
from tracer.options import TraceError, TraceOptions
from tracer.record.listeners import Listener
from tracer.record.protocol import RecorderAPI
from tracer.record.recorder import Recorder, active_recorder
from tracer.record.tensors import ACCUMULATE


# Node hooks of a scope without a trace: module-level so they capture only the plain Follow.
def _hook_begin(fol: Follow, grad_outputs: tuple[Any, ...]) -> None:
    try:
        with torch._C.DisableTorchFunction():
            emit_node(fol, "begin", None, None, grad_outputs)
    except Exception as exc:
        internal_error(exc)


def _hook_end(fol: Follow, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
    try:
        with torch._C.DisableTorchFunction():
            emit_node(fol, "end", None, None, grad_inputs)
    except Exception as exc:
        internal_error(exc)


def _hook_end_once(fol: Follow, handles: list[Any], grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
    """An accumulator's end, once: a parameter's accumulator outlives the scope's graph (the next
    graph through the parameter reuses it), so its hooks go after the run the scope caused."""
    _hook_end(fol, grad_inputs, grad_outputs)
    for h in handles:
        h.remove()
    handles.clear()


# The recorder a ``log_scope`` runs when no trace is active: names only, no hashing, every op of
# an optimizer step (as a log scope always showed them).
LIGHT = TraceOptions(hash="none", stacks=False, stats=False, optimizer_ops=True)


class _LogListener(Listener):
    """Logs the calls and grad nodes of one recorder: scoped ones, and the rest by global levels."""

    def __init__(self, rec: RecorderAPI, light: bool = False) -> None:
        self._rec = weakref.ref(rec)
        # A scope's own recorder (no trace active): the listener hooks the grad node objects it
        # follows itself, so it keeps those the recorder names during a call (let go after it).
        self.light = light
        self.scopes: list[LogScope] = []
        self.nodes: dict[str, Follow] = {}
        self.cursor = len(rec.trace.grad_nodes)
        self.fresh: dict[str, Any] = {}

    def on_grad_node(self, trace: Trace, name: str, node: Any) -> None:
        if self.light:
            self.fresh[name] = node

    # ---- forward ----------------------------------------------------------------------------------
    def on_call(self, trace: Trace, call: Call, token: Any, outputs: list[torch.Tensor]) -> None:
        try:
            self._on_call(trace, call, outputs)
        except Exception as exc:
            internal_error(exc)
        finally:
            self.fresh.clear()

    def _on_call(self, trace: Trace, call: Call, outputs: list[torch.Tensor]) -> None:
        rec = self._rec()
        depth = _function_depth(rec)
        new = trace.grad_nodes[self.cursor:]
        self.cursor = len(trace.grad_nodes)
        if call.phase == "backward":  # a custom Function applied inside a grad node's backward
            running = self.nodes.get(_running_node(rec) or "")
            if running is not None and running.level is not None:
                if running.active:
                    emit(BACKWARD, running.level,
                          call_line(trace, call, outputs, running.level, running.indent + 1 + depth, "bwd"))
            else:
                detail = detail_of(user_level("backward"))
                if detail is not None:
                    emit(BACKWARD, detail, call_line(trace, call, outputs, detail, depth, "bwd"))
            self._remember(new, call, depth, None)
            return
        indent = module_depth(call.module) + depth
        detail = detail_of(FORWARD.getEffectiveLevel())
        if detail is not None:
            emit(FORWARD, detail, call_line(trace, call, outputs, detail, indent))
        scope = self.scopes[-1] if self.scopes else None
        level = detail_of(BACKWARD.getEffectiveLevel()) if scope is not None and scope.backward else None
        self._remember(new, call, indent, (scope, level) if scope is not None and level is not None else None)

    def _remember(self, new: list[GradNode], call: Call, indent: int,
                  scoped: tuple[LogScope, int] | None) -> None:
        """Note the nodes made since the last call; follow those of this call when in a scope."""
        mine = set(call.grad_nodes)
        api = api_label(call)
        followed: set[str] = set()
        for g in new:
            if g.name in mine:
                fol = Follow(g.name, indent, call.module, api, None)
            elif g.kind == ACCUMULATE and g.param is not None:
                owner = g.param.rsplit(".", 1)[0] if "." in g.param else ""
                fol = Follow(g.name, module_depth(owner), owner, "", None, acc=True)
            else:
                fol = Follow(g.name, 0, "", "", None)
            self.nodes[g.name] = fol
        if scoped is not None:
            scope, level = scoped
            reached = {d for g in new if g.name in mine for d in g.next if d is not None}
            for g in new:
                fol = self.nodes[g.name]
                if g.name in mine or (fol.acc and g.name in reached):
                    fol.level = level
                    followed.add(g.name)
                    scope._follow(fol, self.fresh.get(g.name) if self.light else None)
            if not self.light:
                # A parameter's accumulator is one node for the whole trace, made at its first
                # use: a later scope that reaches it follows it again (an unscoped use in between
                # stopped it), as a scope without a trace does with the node of each graph.
                made = {g.name for g in new}
                for name in reached - made:
                    acc = self.nodes.get(name)
                    if acc is not None and acc.acc:
                        acc.level, acc.active = level, True
                        followed.add(name)
                        scope._follow(acc, None)
        # A leaf accumulator of a scope reached from a node outside it: no longer only the scope's.
        for g in new:
            if g.name in followed:
                continue
            for d in g.next:
                follow = self.nodes.get(d) if d is not None else None
                if follow is not None and follow.acc and follow.level is not None:
                    follow.active = False

    # ---- backward (inside a trace; a scope without a trace uses its own node hooks) -------------
    def on_node_begin(self, trace: Trace, node: str, step: NodeRun, grads: tuple[Any, ...]) -> None:
        self._node_event("begin", trace, node, step.grads_in, grads)

    def on_node_end(self, trace: Trace, node: str, step: NodeRun, grads: tuple[Any, ...]) -> None:
        self._node_event("end", trace, node, step.grads_out, grads)

    def _node_event(self, event: str, trace: Trace, node: str, names: list[str | None],
                    grads: tuple[Any, ...]) -> None:
        if self.light:
            return
        try:
            fol = self.nodes.get(node) or Follow(node, 0, "", "", None)
            emit_node(fol, event, trace, names, grads)
        except Exception as exc:
            internal_error(exc)


def _function_depth(rec: RecorderAPI | None) -> int:
    # How many custom Functions enclose the call being reported (the recorder's open stack).
    return rec.function_depth if rec is not None else 0


def _running_node(rec: RecorderAPI | None) -> str | None:
    return rec.running_node if rec is not None else None


def _listener_of(rec: RecorderAPI) -> _LogListener | None:
    return next((li for li in rec.listeners if isinstance(li, _LogListener)), None)


def attach_if_enabled(rec: RecorderAPI | None) -> None:
    """Attach the log listener to a recorder when a gradtrace level would log something.

    ``tracer.trace()`` calls this when it starts, and ``set_log_level`` when a trace is active,
    so global levels log traced calls; when nothing is enabled nothing is attached (no cost).
    """
    _attach_if_enabled(rec)


def _attach_if_enabled(rec: RecorderAPI | None) -> None:
    if rec is None or rec.closed or _listener_of(rec) is not None:
        return
    if FORWARD.isEnabledFor(logging.INFO) or BACKWARD.isEnabledFor(logging.INFO):
        rec.listeners.append(_LogListener(rec))


# ---- the scope --------------------------------------------------------------------------------------------
class LogScope:
    """``with tracer.log_scope(...)``: see ``log_scope``. ``nodes`` lists the grad nodes it follows."""

    def __init__(self, level: LevelSpec = "DEBUG", backward: bool = True,
                 torch_logs: str | Mapping[str, Any] | None = None) -> None:
        if isinstance(level, Mapping):
            for k, v in level.items():
                logger_of(str(k))
                parse_level(v)
        else:
            parse_level(level)
        self.level = level
        self.backward = backward
        self._torch = TorchLogs(torch_logs) if torch_logs is not None else None
        self._light: Recorder | None = None
        self._listener: _LogListener | None = None
        self._follows: list[Follow] = []
        self._handles: list[Any] = []
        self._lock = threading.Lock()

    @property
    def nodes(self) -> list[str]:
        """Names of the grad nodes this scope logs when backward runs them."""
        with self._lock:
            return [f.name for f in self._follows if f.active]

    def _follow(self, fol: Follow, node: Any) -> None:
        with self._lock:
            self._follows.append(fol)
            if node is not None:
                pre = node.register_prehook(functools.partial(_hook_begin, fol))
                if fol.acc:
                    own: list[Any] = [pre]
                    own.append(node.register_hook(functools.partial(_hook_end_once, fol, own)))
                    self._handles += own
                else:
                    self._handles += (pre, node.register_hook(functools.partial(_hook_end, fol)))

    def close(self) -> None:
        """Stop logging this scope's grad nodes now (they stop anyway when their graph is freed)."""
        with self._lock:
            for fol in self._follows:
                fol.active = False
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def __enter__(self) -> LogScope:
        push_levels(self, self.level)
        try:
            if self._torch is not None:
                self._torch.enter()
            if FORWARD.isEnabledFor(logging.INFO) or (self.backward and BACKWARD.isEnabledFor(logging.INFO)):
                self._attach()
        except BaseException:
            self._leave()
            raise
        return self

    def _attach(self) -> None:
        rec = active_recorder()
        if rec is not None and not rec.closed:
            if rec.owner != threading.get_ident():
                raise TraceError("tracer.log_scope(): another thread is being traced (or logged); only the "
                                 "thread that holds the active trace can log a scope")
            listener = _listener_of(rec)
            if listener is None:
                listener = _LogListener(rec)
                rec.listeners.append(listener)
        else:
            # Every op of an optimizer step, as a log scope always showed them.
            light = Recorder(Trace(), LIGHT)
            listener = _LogListener(light, light=True)
            light.listeners.append(listener)
            light.install()
            self._light = light
        listener.scopes.append(self)
        self._listener = listener

    def _leave(self) -> None:
        try:
            if self._listener is not None:
                if self in self._listener.scopes:
                    self._listener.scopes.remove(self)
                self._listener.fresh.clear()
                self._listener = None
            if self._light is not None:
                self._light.uninstall()
                self._light.release()
        finally:
            try:
                if self._torch is not None:
                    self._torch.exit()
            finally:
                pop_levels(self)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        light = self._light
        self._leave()
        self._light = None

        if light is not None and isinstance(exc, TraceError) and "already active" in str(exc):
            raise TraceError("tracer.trace() cannot start inside tracer.log_scope() when no trace encloses "
                             "the scope (the scope records its block itself). Put `with tracer.trace():` "
                             "outside `with tracer.log_scope():`.") from exc


def log_scope(level: LevelSpec = "DEBUG", backward: bool = True,
              torch_logs: str | Mapping[str, Any] | None = None) -> LogScope:
    """Log one block of code: its forward calls while it runs, its grad nodes when they run.

    ``level``: the levels inside the block, as for ``set_log_level`` (a level for every
    component, or a dict per component). Each forward call in the block logs one line at the
    ``gradtrace.forward`` level's detail; with ``backward=True`` each grad node created in the
    block logs when backward runs it (``bwd>`` begin, ``bwd<`` end), at the ``gradtrace.backward``
    level the block had, even after the block ended; grad nodes created elsewhere do not.
    ``torch_logs``: PyTorch's own logs for the block only, as a ``TORCH_LOGS`` string
    (``"+dynamo,recompiles"``) or a dict of ``torch._logging.set_logs`` arguments (levels may be
    names). On exit every level returns to what it was before the block, also on an exception.

    Inside ``tracer.trace()`` the trace's recorder is used; without one, a light recorder runs
    for the block only (see the module docs). A scope whose levels log nothing installs nothing.
    """
    return LogScope(level=level, backward=backward, torch_logs=torch_logs)


def set_log_level(level: LevelSpec) -> None:
    """Set gradtrace's log levels at run time.

    ``set_log_level("DEBUG")`` (or a number) sets every component: the ``gradtrace`` logger gets
    the level and each component follows it. ``set_log_level({"forward": "DEBUG", "*": "WARNING"})``
    sets the components named (``"*"`` is the ``gradtrace`` logger, which components without a
    level of their own follow) and leaves the others as they are. Levels take effect inside
    ``tracer.trace()`` blocks and ``log_scope`` blocks (nothing is recorded elsewhere).
    """
    set_levels(level)
    _attach_if_enabled(active_recorder())


def apply_env(text: str | None = None) -> None:
    """Set levels from ``GRADTRACE_LOG`` (or ``text``); a bad value warns and changes nothing."""
    text = os.environ.get(ENV_VAR) if text is None else text
    if not text:
        return
    try:
        spec = parse_env(text)
        for k, v in spec.items():  # validate everything before changing anything
            logger_of(k)
            parse_level(v)
        set_log_level(spec)
    except ValueError as exc:
        warnings.warn(f"{ENV_VAR}={text!r} ignored: {exc}", RuntimeWarning, stacklevel=2)
