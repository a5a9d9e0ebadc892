"""What a log line says: a call or a grad node event at a level of detail, as plain text and as
styled pieces (the console handler colours them), and emitting it."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from tracer.features.logs.levels import BACKWARD, STATS, VALUES, VALUES_MAX_NUMEL, detail_of, user_level
from tracer.model import Call, Stats, Trace
from tracer.model.display import (
    format_number,
    function_label,
    shape_compact,
    short_api,
    short_dtype,
)
from tracer.record.checksums.bytes import unhashable_reason
from tracer.record.checksums.stats import stats_tensor

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


def _shape(dtype: str, shape: tuple[int, ...]) -> str:
    return short_dtype(dtype) + shape_compact(shape)


def _num(x: float | None) -> str:
    return format_number(x, 4)


def api_label(call: Call) -> str:
    """A custom Function by its class (``MyFn.apply``), anything else by its short API."""
    return function_label(call.api) if call.kind == "function" else short_api(call.api)


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


def call_line(trace: Trace, call: Call, outputs: list[torch.Tensor], detail: int, indent: int,
               tag: str = "fwd") -> LogLine:
    pieces: list[Piece] = []
    if detail <= logging.DEBUG:
        ins = _tensor_list(trace, list(call.inputs), [], logging.DEBUG)  # inputs: names and shapes
        if call.args:
            ins += [(", " if ins else "", ""), (call.args, "dim")]
        # outputs: the returned tensors, then tensors changed in place that were not returned.
        names: list[str | None] = [*call.outputs, *(n for n in call.mutated if n not in call.outputs)]
        pieces = [("(", ""), *ins, (") -> ", ""), *_tensor_list(trace, names, list(outputs), detail)]
    return LogLine(tag, indent, call.name, api_label(call), call.module, tuple(pieces))


# ---- following grad nodes ---------------------------------------------------------------------------
@dataclass
class Follow:
    """What a node's log lines need, known when the node is made. Plain data: no tensor, no node."""

    name: str
    indent: int
    module: str
    api: str
    level: int | None  # detail for a node of a scope; None: the user's backward level decides
    acc: bool = False
    active: bool = True


def _node_line(fol: Follow, event: str, trace: Trace | None, names: list[str | None] | None,
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


def emit(logger: logging.Logger, level: int, line: LogLine) -> None:
    # logger.handle, not logger.log: a scope's grad nodes log at the scope's level after the
    # scope restored the logger's own level. Filters, handlers and logging.disable still apply.
    if logger.disabled or logging.root.manager.disable >= level:
        return
    record = logger.makeRecord(logger.name, level, "gradtrace", 0, line.message(), (), None,
                               extra={"gradtrace": line})
    logger.handle(record)


_warned: set[str] = set()


def internal_error(exc: BaseException) -> None:
    # A logging bug must never break the user's forward or backward: warn once per kind.
    key = f"{type(exc).__name__}: {exc}"
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"gradtrace logs: {key}", RuntimeWarning, stacklevel=2)


def emit_node(fol: Follow, event: str, trace: Trace | None, names: list[str | None] | None,
               grads: tuple[Any, ...]) -> None:
    detail = fol.level if fol.level is not None else detail_of(user_level("backward"))
    if detail is None or not fol.active:
        return
    emit(BACKWARD, detail, _node_line(fol, event, trace, names, grads, detail))
