"""The memory timeline of a trace as an inline SVG for the HTML report (no script needed).

Allocated and reserved bytes over the event sequence; backward spans shaded; the peak marked;
each point carries a ``<title>`` (the browser's own hover tooltip) naming the call or grad node
that allocated or freed, how much, and the totals after it. Every string from the trace is
XML-escaped: module and call names are user data.
"""

from __future__ import annotations

from html import escape
from typing import Any

from tracer.model import Trace
from tracer.model.display import format_bytes

WIDTH, HEIGHT, PAD_L, PAD_B, PAD_T = 1100, 320, 70, 30, 20


def memory_svg(trace: Trace, max_points: int = 2000) -> str | None:
    """The timeline SVG, or None when the trace has no memory record."""
    if not trace.memory:
        return None
    from tracer.analysis.memory import memory_timeline_data

    data: dict[str, Any] = memory_timeline_data(trace, max_points=max_points)
    points = data.get("points") or []
    if not points:
        return None
    top = max(max(p["allocated"] or 0, p.get("reserved") or 0) for p in points) or 1
    first, last = points[0]["seq"], points[-1]["seq"]
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
                     f"<title>{escape(tip)}</title></circle>")
    peak = data.get("peak")
    if peak is not None:
        p = points[peak]
        parts.append(f'<circle class="peak" cx="{x(p["seq"]):.1f}" cy="{y(p["allocated"] or 0):.1f}" r="6">'
                     f'<title>{escape("peak: " + format_bytes(int(p["allocated"] or 0)) + " at " + str(p["owner"]))}</title></circle>'
                     f'<text class="peak-label" x="{x(p["seq"]) + 8:.1f}" y="{y(p["allocated"] or 0) - 6:.1f}">'
                     f'peak {escape(format_bytes(int(p["allocated"] or 0)))} · {escape(str(p["owner"]))}</text>')
    parts.append(f'<text class="axis" x="{PAD_L}" y="{HEIGHT - 8}">event {first}</text>'
                 f'<text class="axis" x="{WIDTH - 10}" y="{HEIGHT - 8}" text-anchor="end">event {last}</text>')
    parts.append("</svg>")
    legend = ('<p class="gt-memory-legend"><span class="sw-alloc"></span>allocated '
              '<span class="sw-res"></span>reserved <span class="sw-bwd"></span>backward '
              f'· device {escape(str(data.get("device")))} · source {escape(str(data.get("source")))} '
              '· hover a point for the call or grad node</p>')
    return legend + "".join(parts)


MEMORY_CSS = """
#gt-memory-wrap { position: absolute; inset: 0; overflow: auto; display: none; background: #fff; padding: 12px; }
#gt-view.memory #gt-memory-wrap { display: block; }
#gt-view.memory #gt-graph, #gt-view.memory #gt-zoom, #gt-view.memory #gt-legend { display: none; }
#gt-memory-svg .bwd { fill: #fdf2e9; }
#gt-memory-svg .grid { stroke: #e5e7eb; }
#gt-memory-svg .axis { font: 11px sans-serif; fill: #6b7280; }
#gt-memory-svg .allocated { fill: none; stroke: #2563eb; stroke-width: 1.5; }
#gt-memory-svg .reserved { fill: none; stroke: #9ca3af; stroke-width: 1.2; stroke-dasharray: 4 3; }
#gt-memory-svg .pt { fill: #2563eb; fill-opacity: 0.25; }
#gt-memory-svg .pt:hover { fill-opacity: 1; }
#gt-memory-svg .peak { fill: #dc2626; }
#gt-memory-svg .peak-label { font: bold 12px sans-serif; fill: #dc2626; }
.gt-memory-legend span { display: inline-block; width: 14px; height: 4px; margin: 0 4px 2px 10px; }
.gt-memory-legend .sw-alloc { background: #2563eb; } .gt-memory-legend .sw-res { background: #9ca3af; }
.gt-memory-legend .sw-bwd { background: #fdf2e9; height: 10px; }
"""
