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

import functools
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any

import torch

from tracer.model import Call, GradNode, NodeRun, Stats, Trace
from tracer.options import TraceOptions
from tracer.record.checksums.bytes import unhashable_reason
from tracer.record.checksums.stats import stats_tensor
from tracer.record.listeners import Listener
from tracer.record.recorder import Recorder, active_recorder

ROOT = "gradtrace"
ENV_VAR = "GRADTRACE_LOG"
STATS = 7
VALUES = 5
VALUES_MAX_NUMEL = 16
logging.addLevelName(STATS, "STATS")
logging.addLevelName(VALUES, "VALUES")

# Components with a logger of their own; another module that logs adds its name here.
COMPONENTS: list[str] = ["forward", "backward", "memory"]
_ALIASES = {"NAMES": logging.INFO, "SHAPES": logging.DEBUG, "STATS": STATS, "VALUES": VALUES}

LevelSpec = str | int | Mapping[str, str | int]

_FWD = logging.getLogger(f"{ROOT}.forward")
_BWD = logging.getLogger(f"{ROOT}.backward")
_ACCUMULATE = "AccumulateGrad"


# ---- levels -----------------------------------------------------------------------------------------
def parse_level(value: str | int) -> int:
    """A level given as a number, a ``logging`` name (``"DEBUG"``) or a detail name (``"shapes"``)."""
    if isinstance(value, bool):
        raise ValueError(f"not a log level: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("-").isdigit():
            return int(text)
        key = text.upper()
        if key in _ALIASES:
            return _ALIASES[key]
        known = logging.getLevelName(key)
        if isinstance(known, int):
            return known
    names = "CRITICAL, ERROR, WARNING, INFO, DEBUG, STATS, VALUES, NOTSET, names, shapes, or a number"
    raise ValueError(f"not a log level: {value!r} (use {names})")


def _logger_of(component: str) -> logging.Logger:
    if component == "*":
        return logging.getLogger(ROOT)
    if component not in COMPONENTS:
        raise ValueError(f"unknown log component {component!r}; known: '*', {', '.join(map(repr, COMPONENTS))}")
    return logging.getLogger(f"{ROOT}.{component}")


def set_log_level(level: LevelSpec) -> None:
    """Set gradtrace's log levels at run time.

    ``set_log_level("DEBUG")`` (or a number) sets every component: the ``gradtrace`` logger gets
    the level and each component follows it. ``set_log_level({"forward": "DEBUG", "*": "WARNING"})``
    sets the components named (``"*"`` is the ``gradtrace`` logger, which components without a
    level of their own follow) and leaves the others as they are. Levels take effect inside
    ``tracer.trace()`` blocks and ``log_scope`` blocks (nothing is recorded elsewhere).
    """
    if isinstance(level, Mapping):
        todo = [(_logger_of(str(k)), parse_level(v)) for k, v in level.items()]
        for lg, lv in todo:
            lg.setLevel(lv)
    else:
        lv = parse_level(level)
        logging.getLogger(ROOT).setLevel(lv)
        for lg in _gradtrace_loggers():
            if lg.name != ROOT:
                lg.setLevel(logging.NOTSET)
    _attach_if_enabled(active_recorder())


def get_log_level(component: str | None = None) -> dict[str, str | int] | str | int:
    """Effective level of one component (``"forward"``, ``"*"``...) or, with no argument, of all.

    Levels come back as names where they have one (``"DEBUG"``, ``"STATS"``), else as numbers.
    """
    if component is not None:
        return _level_name(_logger_of(component).getEffectiveLevel())
    return {c: _level_name(_logger_of(c).getEffectiveLevel()) for c in ("*", *COMPONENTS)}


def _level_name(level: int) -> str | int:
    name = logging.getLevelName(level)
    return name if isinstance(name, str) and not name.startswith("Level ") else level


def _gradtrace_loggers() -> list[logging.Logger]:
    out = [logging.getLogger(ROOT)]
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if name.startswith(ROOT + ".") and isinstance(lg, logging.Logger):
            out.append(lg)
    return out


def _snapshot() -> dict[str, int]:
    return {lg.name: lg.level for lg in _gradtrace_loggers()}


def _restore(snap: dict[str, int]) -> None:
    for lg in _gradtrace_loggers():
        # A logger made during the scope did not exist before: it had no level of its own.
        want = snap.get(lg.name, logging.NOTSET)
        if lg.level != want:
            lg.setLevel(want)


def _detail(level: int) -> int | None:
    """The detail a logger at ``level`` gets (the record's level), or None when it is off."""
    if level <= VALUES:
        d = VALUES
    elif level <= STATS:
        d = STATS
    elif level <= logging.DEBUG:
        d = logging.DEBUG
    elif level <= logging.INFO:
        d = logging.INFO
    else:
        return None
    return None if logging.root.manager.disable >= d else d


# Open scopes' saved levels, oldest first. Levels are process-wide while scopes can close in any
# order (threads): each entry holds the levels from before its scope; closing the newest restores
# them, closing an older one hands its saved levels to the next, so the last to close restores
# what was there before the first opened.
_LOCK = threading.RLock()
_SAVED: list[tuple[object, dict[str, int]]] = []


def _push_levels(owner: object, level: LevelSpec) -> None:
    with _LOCK:
        snap = _snapshot()
        try:
            set_log_level(level)
        except BaseException:
            _restore(snap)
            raise
        _SAVED.append((owner, snap))


def _pop_levels(owner: object) -> None:
    with _LOCK:
        i = next((k for k, (o, _) in enumerate(_SAVED) if o is owner), None)
        if i is None:
            return
        _, snap = _SAVED.pop(i)
        if i == len(_SAVED):
            _restore(snap)
        else:
            _SAVED[i] = (_SAVED[i][0], snap)


def _user_level(component: str) -> int:
    """The level the user set, not counting open scopes (they raise levels for their own block)."""
    try:
        base = _SAVED[0][1]
    except IndexError:
        return logging.getLogger(f"{ROOT}.{component}").getEffectiveLevel()
    return base.get(f"{ROOT}.{component}") or base.get(ROOT) or logging.root.getEffectiveLevel()


# ---- what one line says -------------------------------------------------------------------------------
Piece = tuple[str, str]  # (text, style name); the console handler maps style names to colours


@dataclass(frozen=True)
class LogLine:
    """One log line, kept structured so the console handler can align it; ``message()`` is plain.

    ``tag``: ``fwd`` (a forward call), ``bwd>`` (a grad node begins), ``bwd<`` (it ended), ``bwd``
    (a call made inside a grad node). ``indent``: module depth plus custom-Function nesting.
    """

    tag: str
    indent: int
    name: str
    api: str
    module: str
    detail: tuple[Piece, ...] = ()

    def message(self) -> str:
        out = [self.tag, " ", "  " * self.indent, self.name]
        if self.api:
            out += [" ", self.api]
        if self.module:
            out += [" [", self.module, "]"]
        if self.detail:
            out += [" ", "".join(t for t, _ in self.detail)]
        return "".join(out)


_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64",
           "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "complex64": "c64",
           "complex128": "c128"}


def _dtype(dt: str) -> str:
    return _DTYPES.get(dt, dt)


def _shape(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{_dtype(dtype)}[{','.join(map(str, shape))}]"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _short_api(call: Call) -> str:
    api = call.api
    if call.kind == "function":  # module.Class.apply -> Class.apply
        return ".".join(api.rsplit(".", 2)[-2:])
    if api.startswith("torch.nn.functional."):
        return "F." + api[len("torch.nn.functional."):]
    return api


def _module_depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


def _stats_of(tensors: list[torch.Tensor | None]) -> list[Stats | None]:
    """Stats of live tensors, one device fetch per device (None where a tensor has no data)."""
    out: list[Stats | None] = [None] * len(tensors)
    rows: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    with torch._C.DisableTorchFunction(), torch.no_grad():
        for i, t in enumerate(tensors):
            if t is None or unhashable_reason(t) is not None:
                continue
            st = stats_tensor(t)
            if st is not None:
                rows.setdefault(st.device, []).append((i, st))
        for items in rows.values():
            for (i, _), row in zip(items, torch.stack([s for _, s in items]).cpu().tolist()):
                lo, hi, mean, absmax, nan, inf, n_fin = row
                out[i] = Stats(None, None, None, None, int(nan), int(inf)) if n_fin == 0 else \
                    Stats(lo, hi, mean, absmax, int(nan), int(inf))
    return out


def _values_of(t: torch.Tensor) -> str | None:
    if t.numel() > VALUES_MAX_NUMEL or unhashable_reason(t) is not None:
        return None
    with torch._C.DisableTorchFunction(), torch.no_grad():
        x = t.detach()
        if x.is_conj():
            x = x.resolve_conj()
        vals = x.cpu().reshape(-1).tolist()
    if t.dim() == 0:
        return _fmt_value(vals[0])
    return "[" + ", ".join(_fmt_value(v) for v in vals) + "]"


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, complex):
        return f"{v.real:.4g}{v.imag:+.4g}j"
    return str(v)


def _tensor_pieces(trace: Trace | None, name: str | None, live: torch.Tensor | None, detail: int,
                   stats: Stats | None) -> list[Piece]:
    """``name f32[4,8] md5:1a2b3c4d {min=.. ..} = [..]`` for one tensor, as far as the detail goes."""
    rec = trace.tensors.get(name) if trace is not None and name is not None else None
    if name is None and live is None:
        return [("-", "dim")]
    out: list[Piece] = []
    if name is not None:
        out.append((name, "tensor"))
    if rec is not None:
        shape = _shape(rec.dtype, rec.shape)
    elif live is not None:
        shape = _shape(str(live.dtype).replace("torch.", ""), tuple(live.shape))
    else:
        shape = ""
    if shape:
        out.append(((" " if out else "") + shape, "shape"))
    if rec is not None and (rec.md5 or rec.fingerprint):
        out.append((f" md5:{rec.md5[:8]}" if rec.md5 else f" fp:{(rec.fingerprint or '')[:8]}", "hash"))
    if detail <= STATS and stats is not None:
        out.append((f" {{min={_num(stats.min)} max={_num(stats.max)} mean={_num(stats.mean)} "
                    f"absmax={_num(stats.absmax)}", "stats"))
        if stats.nan or stats.inf:
            out.append((f" nan={stats.nan} inf={stats.inf}", "bad"))
        out.append(("}", "stats"))
    if detail <= VALUES and live is not None:
        vals = _values_of(live)
        if vals is not None:
            out.append((f" = {vals}", "values"))
    return out


def _tensor_list(trace: Trace | None, names: list[str | None], live: list[Any], detail: int) -> list[Piece]:
    tensors = [t if isinstance(t, torch.Tensor) else None for t in live]
    tensors += [None] * (len(names) - len(tensors))
    stats = _stats_of(tensors) if detail <= STATS else [None] * len(names)
    out: list[Piece] = []
    for i, name in enumerate(names):
        if i:
            out.append((", ", ""))
        out += _tensor_pieces(trace, name, tensors[i], detail, stats[i])
    return out


def _call_line(trace: Trace, call: Call, outputs: list[torch.Tensor], detail: int, indent: int,
               tag: str = "fwd") -> LogLine:
    pieces: list[Piece] = []
    if detail <= logging.DEBUG:
        ins = _tensor_list(trace, list(call.inputs), [], logging.DEBUG)  # inputs: names and shapes
        if call.args:
            ins += [(", " if ins else "", ""), (call.args, "dim")]
        # outputs: the returned tensors, then tensors changed in place that were not returned.
        names: list[str | None] = [*call.outputs, *(n for n in call.mutated if n not in call.outputs)]
        pieces = [("(", ""), *ins, (") -> ", ""), *_tensor_list(trace, names, list(outputs), detail)]
    return LogLine(tag, indent, call.name, _short_api(call), call.module, tuple(pieces))


# ---- following grad nodes ---------------------------------------------------------------------------
@dataclass
class _Follow:
    """What a node's log lines need, known when the node is made. Plain data: no tensor, no node."""

    name: str
    indent: int
    module: str
    api: str
    level: int | None  # detail for a node of a scope; None: the user's backward level decides
    acc: bool = False
    active: bool = True


def _node_line(fol: _Follow, event: str, trace: Trace | None, names: list[str | None] | None,
               grads: tuple[Any, ...], detail: int) -> LogLine:
    pieces: list[Piece] = []
    if detail <= logging.DEBUG:
        label = "received " if event == "begin" else "produced "
        listed: list[str | None] = list(names) if names is not None else [None] * len(grads)
        live = list(grads) + [None] * (len(listed) - len(grads))
        # A slot without a gradient shows as "-"; without a trace, gradients have no names.
        if listed:  # a leaf accumulator produces nothing
            pieces = [(label, "dim"), *_tensor_list(trace, listed, live, detail)]
    tag = "bwd>" if event == "begin" else "bwd<"
    return LogLine(tag, fol.indent, fol.name, fol.api, fol.module, tuple(pieces))


def _emit(logger: logging.Logger, level: int, line: LogLine) -> None:
    # logger.handle, not logger.log: a scope's grad nodes log at the scope's level after the
    # scope restored the logger's own level. Filters, handlers and logging.disable still apply.
    if logger.disabled or logging.root.manager.disable >= level:
        return
    record = logger.makeRecord(logger.name, level, "gradtrace", 0, line.message(), (), None,
                               extra={"gradtrace": line})
    logger.handle(record)


_warned: set[str] = set()


def _internal_error(exc: BaseException) -> None:
    # A logging bug must never break the user's forward or backward: warn once per kind.
    key = f"{type(exc).__name__}: {exc}"
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"gradtrace logs: {key}", RuntimeWarning, stacklevel=2)


def _emit_node(fol: _Follow, event: str, trace: Trace | None, names: list[str | None] | None,
               grads: tuple[Any, ...]) -> None:
    detail = fol.level if fol.level is not None else _detail(_user_level("backward"))
    if detail is None or not fol.active:
        return
    _emit(_BWD, detail, _node_line(fol, event, trace, names, grads, detail))


# Node hooks of a scope without a trace: module-level so they capture only the plain _Follow.
def _hook_begin(fol: _Follow, grad_outputs: tuple[Any, ...]) -> None:
    try:
        with torch._C.DisableTorchFunction():
            _emit_node(fol, "begin", None, None, grad_outputs)
    except Exception as exc:
        _internal_error(exc)


def _hook_end(fol: _Follow, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
    try:
        with torch._C.DisableTorchFunction():
            _emit_node(fol, "end", None, None, grad_inputs)
    except Exception as exc:
        _internal_error(exc)


# The recorder a ``log_scope`` runs when no trace is active: names only, no hashing, every op of
# an optimizer step (as a log scope always showed them).
LIGHT = TraceOptions(hash="none", stacks=False, stats=False, optimizer_ops=True)


class _LogListener(Listener):
    """Logs the calls and grad nodes of one recorder: scoped ones, and the rest by global levels."""

    def __init__(self, rec: Recorder, light: bool = False) -> None:
        self._rec = weakref.ref(rec)
        # A scope's own recorder (no trace active): the listener hooks the grad node objects it
        # follows itself, so it keeps those the recorder names during a call (let go after it).
        self.light = light
        self.scopes: list[LogScope] = []
        self.nodes: dict[str, _Follow] = {}
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
            _internal_error(exc)
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
                    _emit(_BWD, running.level,
                          _call_line(trace, call, outputs, running.level, running.indent + 1 + depth, "bwd"))
            else:
                detail = _detail(_user_level("backward"))
                if detail is not None:
                    _emit(_BWD, detail, _call_line(trace, call, outputs, detail, depth, "bwd"))
            self._remember(new, call, depth, None)
            return
        indent = _module_depth(call.module) + depth
        detail = _detail(_FWD.getEffectiveLevel())
        if detail is not None:
            _emit(_FWD, detail, _call_line(trace, call, outputs, detail, indent))
        scope = self.scopes[-1] if self.scopes else None
        level = _detail(_BWD.getEffectiveLevel()) if scope is not None and scope.backward else None
        self._remember(new, call, indent, (scope, level) if scope is not None and level is not None else None)

    def _remember(self, new: list[GradNode], call: Call, indent: int,
                  scoped: tuple[LogScope, int] | None) -> None:
        """Note the nodes made since the last call; follow those of this call when in a scope."""
        mine = set(call.grad_nodes)
        api = _short_api(call)
        followed: set[str] = set()
        for g in new:
            if g.name in mine:
                fol = _Follow(g.name, indent, call.module, api, None)
            elif g.kind == _ACCUMULATE and g.param is not None:
                owner = g.param.rsplit(".", 1)[0] if "." in g.param else ""
                fol = _Follow(g.name, _module_depth(owner), owner, "", None, acc=True)
            else:
                fol = _Follow(g.name, 0, "", "", None)
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
        # A leaf accumulator of a scope reached from a node outside it: no longer only the scope's.
        for g in new:
            if g.name in followed:
                continue
            for d in g.next:
                fol = self.nodes.get(d) if d is not None else None
                if fol is not None and fol.acc and fol.level is not None:
                    fol.active = False

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
            fol = self.nodes.get(node) or _Follow(node, 0, "", "", None)
            _emit_node(fol, event, trace, names, grads)
        except Exception as exc:
            _internal_error(exc)


def _function_depth(rec: Recorder | None) -> int:
    # How many custom Functions enclose the call being reported (the recorder's open stack).
    return rec.function_depth if rec is not None else 0


def _running_node(rec: Recorder | None) -> str | None:
    return rec.running_node if rec is not None else None


def _listener_of(rec: Recorder) -> _LogListener | None:
    return next((li for li in rec.listeners if isinstance(li, _LogListener)), None)


def attach_if_enabled(rec: Recorder | None) -> None:
    """Attach the log listener to a recorder when a gradtrace level would log something.

    ``tracer.trace()`` calls this when it starts, and ``set_log_level`` when a trace is active,
    so global levels log traced calls; when nothing is enabled nothing is attached (no cost).
    """
    _attach_if_enabled(rec)


def _attach_if_enabled(rec: Recorder | None) -> None:
    if rec is None or rec.closed or _listener_of(rec) is not None:
        return
    if _FWD.isEnabledFor(logging.INFO) or _BWD.isEnabledFor(logging.INFO):
        rec.listeners.append(_LogListener(rec))


# ---- PyTorch's own logs, scoped ------------------------------------------------------------------------
class _TorchLogs:
    """``torch._logging`` settings for the duration of a block, put back exactly afterwards."""

    def __init__(self, spec: str | Mapping[str, Any]) -> None:
        if not isinstance(spec, str | Mapping):
            raise TypeError(f"torch_logs must be a TORCH_LOGS string or a dict for torch._logging.set_logs, "
                            f"got {type(spec).__name__}")
        self.spec = spec
        self.saved: tuple[Any, dict[str, tuple[int, bool, list[logging.Handler]]]] | None = None

    @staticmethod
    def _internal() -> Any:
        try:
            from torch._logging import _internal
        except ImportError as exc:  # pragma: no cover - very old or very new torch
            raise RuntimeError("this torch has no torch._logging; torch_logs= is not available") from exc
        return _internal

    @staticmethod
    def _names(internal: Any) -> set[str]:
        reg = internal.log_registry
        return {"torch", *reg.get_log_qnames(), *reg.get_artifact_log_qnames(), *reg.get_child_log_qnames()}

    def enter(self) -> None:
        internal = self._internal()
        if "TORCH_LOGS" in os.environ:  # torch ignores set_logs then; so do we, and say so
            warnings.warn("TORCH_LOGS is set in the environment; log_scope(torch_logs=...) is ignored",
                          RuntimeWarning, stacklevel=3)
            return
        state = internal._get_log_state()
        saved_state = type(state)(dict(state.log_qname_to_level), set(state.artifact_names))
        loggers = {n: (lg.level, lg.propagate, list(lg.handlers))
                   for n in self._names(internal) for lg in [logging.getLogger(n)]}
        self.saved = (saved_state, loggers)
        try:
            if isinstance(self.spec, str):
                internal._set_log_state(internal._parse_log_settings(self.spec))
                internal._init_logs()
            else:
                torch._logging.set_logs(**{k: v if isinstance(v, bool) or k == "modules" else parse_level(v)
                                           for k, v in self.spec.items()})
        except BaseException:
            self.exit()
            raise

    def exit(self) -> None:
        if self.saved is None:
            return
        internal = self._internal()
        state, loggers = self.saved
        self.saved = None
        internal._set_log_state(state)
        internal._init_logs()
        # _init_logs rebuilds handlers and levels from the state; put back what was there exactly
        # (a level set by hand, the very handler objects) and undo loggers the block registered.
        for name in self._names(internal):
            lg = logging.getLogger(name)
            if name in loggers:
                level, propagate, handlers = loggers[name]
                lg.setLevel(level)
                lg.propagate = propagate
                lg.handlers[:] = handlers
            else:
                internal._clear_handlers(lg)
                lg.setLevel(logging.NOTSET)
                lg.propagate = True


# ---- the scope --------------------------------------------------------------------------------------------
class LogScope:
    """``with tracer.log_scope(...)``: see ``log_scope``. ``nodes`` lists the grad nodes it follows."""

    def __init__(self, level: LevelSpec = "DEBUG", backward: bool = True,
                 torch_logs: str | Mapping[str, Any] | None = None) -> None:
        if isinstance(level, Mapping):
            for k, v in level.items():
                _logger_of(str(k))
                parse_level(v)
        else:
            parse_level(level)
        self.level = level
        self.backward = backward
        self._torch = _TorchLogs(torch_logs) if torch_logs is not None else None
        self._light: Recorder | None = None
        self._listener: _LogListener | None = None
        self._follows: list[_Follow] = []
        self._handles: list[Any] = []
        self._lock = threading.Lock()

    @property
    def nodes(self) -> list[str]:
        """Names of the grad nodes this scope logs when backward runs them."""
        with self._lock:
            return [f.name for f in self._follows if f.active]

    def _follow(self, fol: _Follow, node: Any) -> None:
        with self._lock:
            self._follows.append(fol)
            if node is not None:
                self._handles.append(node.register_prehook(functools.partial(_hook_begin, fol)))
                self._handles.append(node.register_hook(functools.partial(_hook_end, fol)))

    def close(self) -> None:
        """Stop logging this scope's grad nodes now (they stop anyway when their graph is freed)."""
        with self._lock:
            for fol in self._follows:
                fol.active = False
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def __enter__(self) -> LogScope:
        _push_levels(self, self.level)
        try:
            if self._torch is not None:
                self._torch.enter()
            if _FWD.isEnabledFor(logging.INFO) or (self.backward and _BWD.isEnabledFor(logging.INFO)):
                self._attach()
        except BaseException:
            self._leave()
            raise
        return self

    def _attach(self) -> None:
        rec = active_recorder()
        if rec is not None and not rec.closed:
            if rec.owner != threading.get_ident():
                from tracer.options import TraceError

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
        finally:
            try:
                if self._torch is not None:
                    self._torch.exit()
            finally:
                _pop_levels(self)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        light = self._light
        self._leave()
        self._light = None
        from tracer.options import TraceError

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


# ---- the console handler -----------------------------------------------------------------------------
_STYLES = {"fwd": "cyan", "bwd>": "magenta", "bwd<": "magenta", "bwd": "magenta", "name": "bold",
           "api": "blue", "module": "green", "tensor": "", "shape": "yellow", "hash": "dim",
           "stats": "dim cyan", "bad": "bold red", "values": "", "dim": "dim", "": ""}


class ConsoleHandler(logging.Handler):
    """Aligned, coloured lines on a terminal, the same columns without colour elsewhere.

    Columns: tag (``fwd``, ``bwd>``, ``bwd<``), name indented by module depth and custom-Function
    nesting, API, ``[module path]``, details. Column widths grow to the widest value seen, so
    lines stay aligned. ``stream`` defaults to ``sys.stderr`` at the time of each line; ``width``
    wraps details under their column (default: the terminal's width, no wrapping elsewhere);
    ``color`` forces colour on or off (default: only on a terminal).
    """

    def __init__(self, stream: IO[str] | None = None, width: int | None = None, color: bool | None = None,
                 level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.stream = stream
        self.width = width
        self.color = color
        self.widths = [4, 28, 14, 0]
        self._console: Any = None
        self._console_stream: Any = None

    def _get_console(self) -> Any:
        from rich.console import Console

        stream = self.stream if self.stream is not None else sys.stderr
        if self._console is None or self._console_stream is not stream:
            kwargs: dict[str, Any] = {"file": stream, "highlight": False, "markup": False, "emoji": False}
            if self.color is False:
                kwargs["color_system"] = None
            elif self.color:
                kwargs["force_terminal"] = True
            if self.width is not None:
                kwargs["width"] = self.width
            self._console = Console(**kwargs)
            self._console_stream = stream
        return self._console

    def render(self, line: LogLine, console: Any) -> list[Any]:
        """The line as rich ``Text`` lines (the first, then wrapped continuations)."""
        from rich.text import Text

        cols = [line.tag, "  " * line.indent + line.name, line.api, f"[{line.module}]" if line.module else ""]
        for i, c in enumerate(cols):
            self.widths[i] = max(self.widths[i], len(c))
        prefix = Text()
        styles = [_STYLES.get(line.tag, ""), "name", "api", "module"]
        for i, c in enumerate(cols):
            if not self.widths[i]:
                continue
            prefix.append(c, style=_STYLES.get(styles[i], styles[i]) or None)
            prefix.append(" " * (self.widths[i] - len(c) + 1))
        detail = Text()
        for text, style in line.detail:
            detail.append(text, style=_STYLES.get(style) or None)
        width = self.width if self.width is not None else (console.width if console.is_terminal else None)
        avail = (width - len(prefix)) if width is not None else 0
        if not line.detail or width is None or avail < 24 or len(detail) <= avail:
            out = prefix + detail
            out.rstrip()
            return [out]
        wrapped = detail.wrap(console, avail, overflow="fold")
        lines = []
        for k, part in enumerate(wrapped):
            head = prefix if k == 0 else Text(" " * len(prefix))
            row = head + part
            row.rstrip()
            lines.append(row)
        return lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            console = self._get_console()
            line = getattr(record, "gradtrace", None)
            if isinstance(line, LogLine):
                rows = self.render(line, console)
            else:
                from rich.text import Text

                rows = [Text(f"{record.levelname.lower()} {record.name}: {record.getMessage()}")]
            for row in rows:
                console.print(row, soft_wrap=True)
        except Exception:
            self.handleError(record)


def configure_console(enabled: bool = True, *, stream: IO[str] | None = None, width: int | None = None,
                      color: bool | None = None) -> ConsoleHandler | None:
    """Replace gradtrace's console handler (or remove it: records then propagate to the root logger)."""
    lg = logging.getLogger(ROOT)
    for h in [h for h in lg.handlers if isinstance(h, ConsoleHandler)]:
        lg.removeHandler(h)
    if not enabled:
        lg.propagate = True
        return None
    handler = ConsoleHandler(stream=stream, width=width, color=color)
    lg.addHandler(handler)
    lg.propagate = False
    return handler


# ---- GRADTRACE_LOG ------------------------------------------------------------------------------------
def parse_env(text: str) -> dict[str, str]:
    """``"forward=DEBUG,backward=INFO"`` -> ``{"forward": "DEBUG", "backward": "INFO"}``; a bare
    level (``"DEBUG"``) is ``"*"``, i.e. every component without a level of its own."""
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if sep:
            out[key.strip() or "*"] = value.strip()
        else:
            out["*"] = key
    return out


def apply_env(text: str | None = None) -> None:
    """Set levels from ``GRADTRACE_LOG`` (or ``text``); a bad value warns and changes nothing."""
    text = os.environ.get(ENV_VAR) if text is None else text
    if not text:
        return
    try:
        spec = parse_env(text)
        for k, v in spec.items():  # validate everything before changing anything
            _logger_of(k)
            parse_level(v)
        set_log_level(spec)
    except ValueError as exc:
        warnings.warn(f"{ENV_VAR}={text!r} ignored: {exc}", RuntimeWarning, stacklevel=2)


def _init() -> None:
    lg = logging.getLogger(ROOT)
    if lg.level == logging.NOTSET:
        lg.setLevel(logging.WARNING)
    if not any(isinstance(h, ConsoleHandler) for h in lg.handlers):
        configure_console(True)
    apply_env()


_init()

__all__ = ["COMPONENTS", "STATS", "VALUES", "VALUES_MAX_NUMEL", "ConsoleHandler", "LogLine", "LogScope",
           "attach_if_enabled", "configure_console", "get_log_level", "log_scope", "parse_env",
           "parse_level", "set_log_level"]
