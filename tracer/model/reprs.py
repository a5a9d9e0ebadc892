"""How one record reads in a REPL and in a notebook: a one-line ``repr`` and a compact HTML card.

Every string of a trace came from a file that may be hostile (a module named ``<script>``, a
path with quotes, a zero-width space), so each one goes through ``inert`` and ``html.escape`` here
and nothing here writes a script or an event handler. Strings are clipped (``clip``) before
escaping, so a card stays small whatever the trace holds. The records call these from their ``__repr__`` and
``_repr_html_``; the cards of the analyses and of diff results are built with ``card``.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import quote

from tracer.model.display import clip, format_number, inert, shape_compact, short_api, short_dtype

if TYPE_CHECKING:
    from tracer.model.records import BackwardRun, Call, Frame, GradNode, TensorRecord

NAME_LIMIT = 80  # characters of one name or fact in a repr or a card (the rest is "…")
LIST_LIMIT = 4  # names listed per field of a card before "+N more"
CARD_STYLE = "font-family:sans-serif;font-size:12px;line-height:1.4"


def esc(text: object, limit: int = NAME_LIMIT) -> str:
    """A string of the trace, clipped to ``limit`` characters, its control and invisible
    characters shown as escapes (``inert``: ``lin\\u200bear0``), then escaped for HTML."""
    return html.escape(inert(clip(str(text), limit)), quote=True)


def names(items: Sequence[str | None], limit: int = LIST_LIMIT) -> str:
    """``a, b, c +2 more`` in plain text (a repr), ``-`` when empty."""
    shown = [clip(x or "-", NAME_LIMIT) for x in items[:limit]]
    more = f" +{len(items) - limit} more" if len(items) > limit else ""
    return (", ".join(shown) + more) if shown else "-"


def names_html(items: Sequence[str | None], limit: int = LIST_LIMIT) -> str:
    """The names as ``<code>`` elements, ``+N more`` past ``limit``."""
    shown = [f"<code>{esc(x or '-')}</code>" for x in items[:limit]]
    more = f" +{len(items) - limit} more" if len(items) > limit else ""
    return (", ".join(shown) + more) if shown else "–"


def source_link(frame: Frame) -> str:
    """The frame as ``file:line`` linked to the file (``file://`` URL, percent-quoted, so a path
    can never become another scheme or leave the attribute), with its source line as a tooltip."""
    text = f"{os.path.basename(frame.file) or frame.file}:{frame.line}"
    if not os.path.isabs(frame.file):
        return f'<code title="{esc(frame.code, 200)}">{esc(text)}</code>'
    url = "file://" + quote(frame.file.replace(os.sep, "/"), safe="/")
    return (f'<a href="{html.escape(url, quote=True)}" title="{esc(frame.code, 200)}" target="_blank" '
            f'rel="noopener"><code>{esc(text)}</code></a>')


def card(kind: str, title: str, facts: Sequence[tuple[str, str]], note: str = "") -> str:
    """A record as a notebook shows it: ``kind title`` in bold, then one row per fact. ``title``
    and ``note`` are plain text (escaped here); fact values are HTML the caller escaped."""
    rows = "".join(f'<tr><th style="text-align:left;padding-right:8px;font-weight:normal;color:#666">'
                   f"{html.escape(label)}</th><td style=\"text-align:left\">{value}</td></tr>"
                   for label, value in facts)
    extra = f'<div style="color:#d1242f">{esc(note, 300)}</div>' if note else ""
    table = f'<table style="font-size:12px">{rows}</table>' if rows else ""
    return (f'<div class="gradtrace-record" style="{CARD_STYLE}"><b>{html.escape(kind)}</b> '
            f"<code>{esc(title)}</code>{extra}{table}</div>")


def _where(stack: tuple[Frame, ...]) -> list[tuple[str, str]]:
    # The innermost frame: the line that made the record.
    return [("line", source_link(stack[-1]))] if stack else []


# ---- tensors ---------------------------------------------------------------------------------------
def tensor_type(t: TensorRecord) -> str:
    """``f32[2,3,8] cpu``."""
    return f"{short_dtype(t.dtype)}{shape_compact(t.shape)} {t.device}"


def _tensor_values(t: TensorRecord) -> str:
    if t.uninitialized:
        return "uninitialized"
    s = t.stats
    if s is None:
        return ""
    bad = f", {s.nan} NaN" * bool(s.nan) + f", {s.inf} Inf" * bool(s.inf)
    return f"min {format_number(s.min)} max {format_number(s.max)} mean {format_number(s.mean)}{bad}"


def tensor_repr(t: TensorRecord) -> str:
    """``<TensorRecord linear0:out f32[2,3,4] cpu output of linear0 md5 1a2b3c4d5e6f>``."""
    parts = [f"<TensorRecord {clip(t.name, NAME_LIMIT)} {tensor_type(t)} {t.role}"]
    if t.producer:
        parts.append(f"of {clip(t.producer, NAME_LIMIT)}")
    if t.requires_grad:
        parts.append("requires_grad")
    if t.md5:
        parts.append(f"md5 {t.md5[:12]}")
    elif t.hash_note:
        parts.append(f"not hashed: {clip(t.hash_note, NAME_LIMIT)}")
    if t.stats is not None and not t.stats.finite:
        parts.append(f"NaN {t.stats.nan} Inf {t.stats.inf}")
    return inert(" ".join(parts) + ">")


def tensor_html(t: TensorRecord) -> str:
    facts = [("type", f"<code>{esc(tensor_type(t))}</code>"), ("role", esc(t.role))]
    if t.producer:
        facts.append(("made by", names_html([t.producer])))
    if t.previous:
        facts.append(("replaces", names_html([t.previous])))
    if t.md5:
        facts.append(("md5", f"<code>{esc(t.md5)}</code>"))
    elif t.hash_note:
        facts.append(("not hashed", esc(t.hash_note)))
    values = _tensor_values(t)
    if values:
        facts.append(("values", esc(values)))
    bad = t.stats is not None and not t.stats.finite
    return card("tensor", t.name, facts, note="holds NaN or Inf" if bad else "")


# ---- calls -----------------------------------------------------------------------------------------
def call_repr(c: Call) -> str:
    """``<Call linear0 F.linear op in 0.l1: x, 0.l1.weight, 0.l1.bias -> linear0:out>``."""
    where = f" in {clip(c.module, NAME_LIMIT)}" if c.module else ""
    kind = c.kind if c.phase == "forward" else f"{c.kind}, {c.phase}"
    error = f" raised {clip(c.error, NAME_LIMIT)}" if c.error else ""
    return inert(f"<Call {clip(c.name, NAME_LIMIT)} {clip(short_api(c.api), NAME_LIMIT)} {kind}{where}: "
                 f"{names(c.inputs)} -> {names(c.outputs)}{error}>")


def call_html(c: Call) -> str:
    facts = [("API", f"<code>{esc(c.api)}</code> ({esc(c.kind)}, {esc(c.phase)})"),
             ("module", f"<code>{esc(c.module or '<root>')}</code>"),
             ("inputs", names_html(c.inputs)), ("outputs", names_html(c.outputs))]
    if c.mutated:
        facts.append(("mutated", names_html(c.mutated)))
    if c.grad_nodes:
        facts.append(("grad nodes", names_html(c.grad_nodes)))
    if c.parent:
        facts.append(("inside", names_html([c.parent])))
    if c.args:
        facts.append(("args", f"<code>{esc(c.args)}</code>"))
    facts += _where(c.stack)
    return card("call", c.name, facts, note=f"raised {c.error}" if c.error else "")


# ---- grad nodes and backward runs ------------------------------------------------------------------
def node_repr(n: GradNode) -> str:
    """``<GradNode linear0/AddmmBackward0 of linear0 -> 3 edges>``."""
    if n.param:
        origin = f"accumulates into {clip(n.param, NAME_LIMIT)}"
    elif n.call:
        origin = f"of {clip(n.call, NAME_LIMIT)}"
    elif n.parent:
        origin = f"made by the backward of {clip(n.parent, NAME_LIMIT)}"
    else:
        origin = "external" if n.external else "of no recorded call"
    edges = sum(1 for x in n.next if x is not None)
    tail = f" -> {edges} edge{'s' if edges != 1 else ''}" if edges else ""
    name = clip(n.name, NAME_LIMIT)
    kind = "" if n.name.endswith(n.kind) else f" {clip(n.kind, NAME_LIMIT)}"
    return inert(f"<GradNode {name}{kind} {origin}{tail}>")


def node_html(n: GradNode) -> str:
    facts = [("class", f"<code>{esc(n.kind)}</code>")]
    if n.call:
        facts.append(("made by", names_html([n.call])))
    if n.param:
        facts.append(("accumulates into", names_html([n.param])))
    if n.parent:
        facts.append(("made by the backward of", names_html([n.parent])))
    facts.append(("next", names_html(n.next)))
    if n.grads_in:
        facts.append(("gradients in", names_html(n.grads_in)))
    if n.grads_out:
        facts.append(("gradients out", names_html(n.grads_out)))
    facts += _where(n.stack)
    return card("grad node", n.name, facts, note="made before the traced block" if n.external else "")


def backward_repr(b: BackwardRun) -> str:
    """``<BackwardRun backward0 Tensor.backward from mean0:out: 9 steps, ok>``."""
    return inert(f"<BackwardRun {clip(b.name, NAME_LIMIT)} {clip(b.api, NAME_LIMIT)} from {names(b.roots)}: "
                 f"{len(b.steps)} step{'s' if len(b.steps) != 1 else ''}, {b.status}>")


def backward_html(b: BackwardRun) -> str:
    facts = [("API", f"<code>{esc(b.api)}</code>"), ("roots", names_html(b.roots)),
             ("steps", f"{len(b.steps)}: {names_html(b.order)}"), ("status", esc(b.status))]
    if b.outputs:
        facts.append(("outputs", names_html(b.outputs)))
    facts += _where(b.stack)
    return card("backward run", b.name, facts, note=f"failed: {b.error}" if b.error else "")
