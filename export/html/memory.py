"""The Memory tab of the HTML report: the timeline as an inline SVG, then the tables
``gradtrace memory`` prints (no script needed for either).

Allocated and reserved bytes over the event sequence; backward spans shaded; the peak marked;
each point carries a ``<title>`` (the browser's own hover tooltip) naming the call or grad node
that allocated or freed, how much, and the totals after it. The tables come from the same data
as the command's (``tracer.analysis.memory_views.record_tables_data``): totals per device, top
allocators, per module, forward vs backward, the tensors live at the peak. Every string from the
trace is escaped, its control and invisible characters shown as escapes (``inert``): module and
call names are user data. Styled by ``assets/memory.css``; the page's script turns the names in
the tables (each cell also holds its name whole, in ``data-name``) into links to the graph.
"""

from __future__ import annotations

from html import escape
from typing import Any

from tracer.analysis.memory import MemoryRecord, memory_timeline_data
from tracer.analysis.memory_views import record_tables_data
from tracer.model import Trace
from tracer.model.display import format_bytes, inert

WIDTH, HEIGHT, PAD_L, PAD_B, PAD_T = 1100, 320, 70, 30, 20
TABLE_ROWS = 15  # rows per table, as ``gradtrace memory``'s default --top
# Columns whose cells name a call, grad node or tensor (the page links them to the graph).
NAME_COLUMNS = frozenset({"owner", "producer", "allocated by", "live tensor"})


def _text(value: object) -> str:
    """A string of the trace as HTML text: control and invisible characters escaped, then HTML."""
    return escape(inert(str(value)))


def memory_svg(trace: Trace, max_points: int = 2000) -> str | None:
    """The timeline SVG, or None when the trace has no memory record."""
    if not trace.memory:
        return None
    data: dict[str, Any] = memory_timeline_data(trace, max_points=max_points)
    points = data.get("points") or []
    if not points:
        return None
    top = float(max(max(p["allocated"] or 0, p.get("reserved") or 0) for p in points) or 1)
    first, last = int(points[0]["seq"]), int(points[-1]["seq"])
    span = max(last - first, 1)
    plot_w, plot_h = WIDTH - PAD_L - 10, HEIGHT - PAD_B - PAD_T

    def x(seq: int) -> float:
        return PAD_L + (seq - first) / span * plot_w

    def y(v: float) -> float:
        return PAD_T + plot_h - (v / top) * plot_h

    parts = [f'<svg id="gt-memory-svg" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="memory timeline">']
    for lo, hi in data.get("backward") or []:
        parts.append(f'<rect class="bwd" x="{x(lo):.1f}" y="{PAD_T}" width="{max(x(hi) - x(lo), 1):.1f}" '
                     f'height="{plot_h}"><title>backward</title></rect>')
    for frac in (0, 0.25, 0.5, 0.75, 1):
        yy = y(top * frac)
        parts.append(f'<line class="grid" x1="{PAD_L}" x2="{WIDTH - 10}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
                     f'<text class="axis" x="{PAD_L - 6}" y="{yy + 4:.1f}" text-anchor="end">{format_bytes(int(top * frac))}</text>')
    for key, cls in (("reserved", "reserved"), ("allocated", "allocated")):
        pts = " ".join(f"{x(p['seq']):.1f},{y(p[key]):.1f}" for p in points if p.get(key) is not None)
        if pts:
            parts.append(f'<polyline class="{cls}" points="{pts}"/>')
    for p in points:
        tip = (f"#{p['seq']} {p['action']} {format_bytes(int(p['bytes'] or 0))} by {p['owner'] or '(unattributed)'} "
               f"[{p['phase']}] → allocated {format_bytes(int(p['allocated'] or 0))}"
               + (f", reserved {format_bytes(int(p['reserved']))}" if p.get("reserved") is not None else ""))
        parts.append(f'<circle class="pt" cx="{x(p["seq"]):.1f}" cy="{y(p["allocated"] or 0):.1f}" r="2.5">'
                     f"<title>{_text(tip)}</title></circle>")
    peak = data.get("peak")
    if peak is not None:
        p = points[peak]
        parts.append(f'<circle class="peak" cx="{x(p["seq"]):.1f}" cy="{y(p["allocated"] or 0):.1f}" r="6">'
                     f'<title>{_text("peak: " + format_bytes(int(p["allocated"] or 0)) + " at " + str(p["owner"]))}</title></circle>'
                     f'<text class="peak-label" x="{x(p["seq"]) + 8:.1f}" y="{y(p["allocated"] or 0) - 6:.1f}">'
                     f'peak {_text(format_bytes(int(p["allocated"] or 0)))} · {_text(str(p["owner"]))}</text>')
    parts.append(f'<text class="axis" x="{PAD_L}" y="{HEIGHT - 8}">event {first}</text>'
                 f'<text class="axis" x="{WIDTH - 10}" y="{HEIGHT - 8}" text-anchor="end">event {last}</text>')
    parts.append("</svg>")
    legend = ('<p class="gt-memory-legend"><span class="sw-alloc"></span>allocated '
              '<span class="sw-res"></span>reserved <span class="sw-bwd"></span>backward '
              f'· device {_text(str(data.get("device")))} · source {_text(str(data.get("source")))} '
              '· hover a point for the call or grad node</p>')
    return legend + "".join(parts)


def memory_tables(trace: Trace, top: int = TABLE_ROWS) -> str:
    """The tables of ``gradtrace memory TRACE --top top`` as HTML ('' without a memory record)."""
    if not trace.memory:
        return ""
    data = record_tables_data(MemoryRecord.from_trace(trace), top)
    parts = ['<section id="gt-memory-tables">']
    for dev, rest in data.totals:
        parts.append(f'<p class="gt-mem-total"><b>{_text(dev)}</b> {_text(rest)}</p>')
    parts.extend(f'<p class="gt-mem-note">{_text(n)}</p>' for n in data.notes)
    for t in data.tables:
        parts.append(f'<table class="gt-mem-table"><caption>{_text(t.title)}</caption><thead><tr>')
        parts.extend(f"<th{_cell_class(c, t.right)}>{_text(c)}</th>" for c in t.columns)
        parts.append("</tr></thead><tbody>")
        for row in t.rows:
            parts.append("<tr>" + "".join(f"<td{_cell_class(c, t.right)}{_name(c, v)}>{_text(v)}</td>"
                                          for c, v in zip(t.columns, row)) + "</tr>")
        parts.append("</tbody></table>")
    parts.append("</section>")
    return "".join(parts)


def _cell_class(column: str, right: frozenset[str]) -> str:
    classes = (["num"] if column in right else []) + (["name"] if column in NAME_COLUMNS else [])
    return f' class="{" ".join(classes)}"' if classes else ""


def _name(column: str, value: str) -> str:
    """A name cell's name whole, for the page's script to link (the cell shows it escaped)."""
    return f' data-name="{escape(value, quote=True)}"' if column in NAME_COLUMNS else ""
