"""Views of memory records: rich tables, CSV, a PNG/SVG plot, timeline data for the HTML report.

Everything here reads a ``tracer.analysis.memory.MemoryRecord`` (plain data), so a saved trace
and a live one render the same. In the tables, "allocated" is bytes allocated by an
owner, "freed" bytes freed while it ran (or right after it: the events marked ``after``), and
"(unattributed)" collects events no call, grad node or backward run was running for.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracer.model.display import format_bytes as _fmt_bytes
from tracer.model.display import plural
from tracer.model.records import PHASES

if TYPE_CHECKING:
    from tracer.analysis.memory import MemoryRecord

CSV_FIELDS = ("seq", "action", "bytes", "device", "addr", "allocated_after", "reserved_after", "owner",
              "after", "phase", "tensor", "module", "kind", "line")

PLAIN_WIDTH = 120
UNATTRIBUTED = "(unattributed)"


class Printable:
    """Rich renderables that also print as plain text with ``print()``."""

    def __init__(self, parts: Iterable[Any]) -> None:
        self.parts = list(parts)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from self.parts

    def __str__(self) -> str:
        return render_text(self)


def render_text(renderable: Any, width: int = PLAIN_WIDTH) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, highlight=False, soft_wrap=False).print(renderable)
    return buf.getvalue()


def _table(title: str, *columns: str, right: Iterable[str] = ()) -> Table:
    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    right = set(right)
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold")
    return t


def _module_label(rec: MemoryRecord, owner: str | None) -> str:
    if owner is None:
        return UNATTRIBUTED
    kind = rec.owner_kind(owner)
    if kind == "backward":
        return "(backward engine)"
    module = rec.module_of(owner)
    return "(top level)" if module == "" else (module or "-")


def _user_line(rec: MemoryRecord, owner: str | None) -> str:
    stack = rec.stack_of(owner)
    if not stack:
        return ""
    f = stack[-1]
    return f"{f.file.rsplit('/', 1)[-1]}:{f.line}"


# ---- the record's tables ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TableData:
    """One table of a view as plain text cells: printed by ``record_tables``, drawn by the HTML report."""

    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    right: frozenset[str] = frozenset()  # columns aligned right (numbers)


@dataclass(frozen=True)
class RecordTablesData:
    """What ``gradtrace memory`` prints: a totals line per device, notes, then the tables."""

    totals: list[tuple[str, str]]  # (device, "(source): N allocs ..., attributed ...")
    notes: list[str]
    tables: list[TableData]


_COUNTS = frozenset({"allocs", "allocated", "frees", "freed"})


def record_tables_data(rec: MemoryRecord, top: int = 15) -> RecordTablesData:
    """Totals per device, top allocators by bytes, per module, forward vs backward, and the peak."""
    totals: list[tuple[str, str]] = []
    for dev in rec.devices():
        allocs = [e for e in rec.allocs if e["device"] == dev]
        frees = [e for e in rec.frees if e["device"] == dev]
        src = rec.source(dev) or "?"
        totals.append((dev, f"({src}): {plural(len(allocs), 'alloc')} {_fmt_bytes(sum(e['bytes'] for e in allocs))}, "
                            f"{plural(len(frees), 'free')} {_fmt_bytes(sum(e['bytes'] for e in frees))}, "
                            f"net {_fmt_bytes(rec.net(dev))}; attributed {rec.attributed_fraction(dev):.1%} of allocated "
                            f"bytes ({rec.attributed_fraction(dev, inside_only=True):.1%} while the owner ran)"))
    notes = []
    if any(rec.source(d) == "storages" for d in rec.devices()):
        notes.append("cpu counts tensor storages made by recorded calls and grad nodes; temporaries inside one op "
                     "are not seen")
    tables: list[TableData] = []

    owners = rec.by_owner()
    rows: list[tuple[str, ...]] = [(owner or UNATTRIBUTED, rec.owner_kind(owner), _module_label(rec, owner), str(d["allocs"]),
             _fmt_bytes(d["alloc_bytes"]), str(d["frees"]), _fmt_bytes(d["free_bytes"]), _user_line(rec, owner))
            for owner, d in sorted(owners.items(), key=lambda kv: (-kv[1]["alloc_bytes"], -kv[1]["free_bytes"],
                                                                   kv[0] or "~"))[:top]]
    tables.append(TableData(f"Top allocators by bytes (of {len(owners)})",
                            ("owner", "kind", "module", "allocs", "allocated", "frees", "freed", "line"), rows, _COUNTS))

    mods: dict[str, list[int]] = {}
    for owner, d in owners.items():
        m = mods.setdefault(_module_label(rec, owner), [0, 0, 0, 0])
        m[0] += d["allocs"]
        m[1] += d["alloc_bytes"]
        m[2] += d["frees"]
        m[3] += d["free_bytes"]
    rows = [(mod, str(na), _fmt_bytes(ba), str(nf), _fmt_bytes(bf))
            for mod, (na, ba, nf, bf) in sorted(mods.items(), key=lambda kv: (-kv[1][1], kv[0]))[:top]]
    tables.append(TableData("Per module", ("module", "allocs", "allocated", "frees", "freed"), rows, _COUNTS))

    rows = []
    for phase in PHASES:  # a phase with no event is shown all the same: forward and backward always
        a = [e for e in rec.allocs if e["phase"] == phase]
        f = [e for e in rec.frees if e["phase"] == phase]
        if a or f or phase != "optimizer":
            rows.append((phase, str(len(a)), _fmt_bytes(sum(e["bytes"] for e in a)), str(len(f)),
                         _fmt_bytes(sum(e["bytes"] for e in f))))
    tables.append(TableData("By phase", ("phase", "allocs", "allocated", "frees", "freed"), rows, _COUNTS))

    for dev in rec.devices()[:2]:
        peak = rec.peak_of(dev)
        if peak is None:
            continue
        title = (f"Peak on {dev}: {_fmt_bytes(peak.allocated)} allocated"
                 f"{'' if peak.reserved is None else f', {_fmt_bytes(peak.reserved)} reserved'} at event "
                 f"#{peak.seq} ({peak.phase}, {peak.owner or UNATTRIBUTED})")
        rows = [(pt.label, _fmt_bytes(pt.bytes), pt.producer or "-", pt.owner or UNATTRIBUTED) for pt in peak.tensors[:top]]
        if len(peak.tensors) > top:
            rest = peak.tensors[top:]
            rows.append((f"... {len(rest)} more", _fmt_bytes(sum(p.bytes for p in rest)), "", ""))
        if peak.untracked:
            rows.append(("(allocated before the record / rounding)", _fmt_bytes(peak.untracked), "", ""))
        tables.append(TableData(title, ("live tensor", "size", "producer", "allocated by"), rows, frozenset({"size"})))
    return RecordTablesData(totals, notes, tables)


def record_tables(rec: MemoryRecord, top: int = 15) -> Printable:
    """``record_tables_data`` as rich tables (``gradtrace memory``, ``MemoryRecord.tables``)."""
    data = record_tables_data(rec, top)
    head = Text()
    for dev, rest in data.totals:
        head.append(dev, style="bold")
        head.append(f" {rest}\n")
    if not data.totals:
        head.append("no allocations or frees recorded\n")
    for note in data.notes:
        head.append(note + "\n", style="dim")
    parts: list[Any] = [head]
    for td in data.tables:
        t = _table(td.title, *td.columns, right=td.right)
        for row in td.rows:
            t.add_row(*row)
        parts.append(t)
    return Printable(parts)


# ---- CSV ---------------------------------------------------------------------------------------------
# A spreadsheet runs a cell that starts with one of these as a formula (CSV injection): a trace
# file is untrusted input, so such a text cell gets a leading apostrophe, which spreadsheets show
# as text and do not display.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: object) -> object:
    """``value`` as a CSV cell: None as empty, a text that could run as a formula made inert."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS):
        return "'" + value
    return value


def write_csv(rec: MemoryRecord, path: str) -> None:
    """Every event as a row of ``CSV_FIELDS``; text cells are neutralised (``csv_cell``)."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_FIELDS)
        for e in rec.events:
            owner = e.get("owner")
            extra = {"module": rec.module_of(owner) or "", "kind": rec.owner_kind(owner),
                     "line": _user_line(rec, owner)}
            w.writerow([csv_cell(extra[k] if k in extra else e.get(k)) for k in CSV_FIELDS])


# ---- timeline ----------------------------------------------------------------------------------------
def timeline_of(rec: MemoryRecord, device: str | None = None, max_points: int = 4000) -> dict[str, Any]:
    """``memory_timeline_data`` of a record."""
    devices = rec.devices()
    dev = device or (devices[0] if devices else None)
    evs = [e for e in rec.events if e["device"] == dev and e["action"] in ("alloc", "free")]
    out: dict[str, Any] = {"device": dev, "devices": devices, "source": rec.source(dev) if dev else None,
                           "points": [], "peak": None, "backward": []}
    if not evs:
        return out
    peak_i = max(range(len(evs)), key=lambda i: (evs[i]["allocated_after"] or 0, -i))
    keep = set(range(len(evs)))
    if len(evs) > max_points:
        per = max(1, (2 * len(evs)) // max_points)
        keep = {peak_i, 0, len(evs) - 1}
        for lo in range(0, len(evs), per):
            chunk = range(lo, min(lo + per, len(evs)))
            keep.add(max(chunk, key=lambda i: evs[i]["allocated_after"] or 0))
            keep.add(min(chunk, key=lambda i: evs[i]["allocated_after"] or 0))
    idx = sorted(keep)
    out["points"] = [{"seq": evs[i]["seq"], "allocated": evs[i]["allocated_after"], "reserved": evs[i]["reserved_after"],
                      "owner": evs[i]["owner"], "phase": evs[i]["phase"], "action": evs[i]["action"],
                      "bytes": evs[i]["bytes"]} for i in idx]
    out["peak"] = idx.index(peak_i)
    spans: list[list[int]] = []
    for e in evs:
        if e["phase"] == "backward":
            if spans and spans[-1][2] == 1:
                spans[-1][1] = e["seq"]
            else:
                spans.append([e["seq"], e["seq"], 1])
        elif spans:
            spans[-1][2] = 0
    out["backward"] = [[a, b] for a, b, _ in spans]
    return out


# ---- plot --------------------------------------------------------------------------------------------
class PlotUnavailable(ImportError):
    """matplotlib is not installed."""


def plot_record(rec: MemoryRecord, path: str, device: str | None = None) -> None:
    """Step plot of allocated (and reserved) bytes over the events of one device; backward spans
    shaded, the peak marked and labelled with its owner. The format follows the suffix (.png, .svg).
    """
    fmt = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    if fmt not in ("png", "svg", "pdf"):
        raise ValueError(f"plot: the file must end in .png, .svg or .pdf, got {path!r}")
    try:
        # matplotlib is optional (pip install gradtrace[memory])
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure  # optional, as above
    except ImportError:
        raise PlotUnavailable("plot needs matplotlib: pip install 'gradtrace[memory]' (or matplotlib)") from None
    data = timeline_of(rec, device, max_points=20000)
    pts = data["points"]
    fig = Figure(figsize=(10, 4), dpi=110)
    FigureCanvasAgg(fig)  # a canvas of our own: pyplot's global state is left alone
    ax = fig.add_subplot(1, 1, 1)
    mib = float(1 << 20)
    if pts:
        xs = [p["seq"] for p in pts]
        ax.step(xs, [(p["allocated"] or 0) / mib for p in pts], where="post", label="allocated", color="#1f77b4")
        if any(p["reserved"] is not None for p in pts):
            ax.step(xs, [(p["reserved"] or 0) / mib for p in pts], where="post", label="reserved",
                    color="#ff7f0e", linestyle="--")
        for i, (a, b) in enumerate(data["backward"]):
            ax.axvspan(a, b, color="#999999", alpha=0.15, label="backward" if i == 0 else None)
        pk = pts[data["peak"]]
        ax.plot([pk["seq"]], [(pk["allocated"] or 0) / mib], marker="v", color="#d62728", linestyle="none",
                label="peak")
        ax.annotate(f"{_fmt_bytes(pk['allocated'])} · {pk['owner'] or UNATTRIBUTED}",
                    xy=(pk["seq"], (pk["allocated"] or 0) / mib), xytext=(6, 6), textcoords="offset points",
                    fontsize=8)
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xlabel("event")
    ax.set_ylabel("MiB")
    ax.set_title(f"memory on {data['device'] or '-'} ({data['source'] or 'no events'})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format=fmt)


# ---- the allocator summary ---------------------------------------------------------------------------
def summary_tables(s: dict[str, Any]) -> Printable:
    parts: list[Any] = []
    if s.get("device") == "cpu":
        t = _table("CPU memory", "figure", "value", right=("value",))
        t.add_row("live tensor bytes (storages Python can reach)", _fmt_bytes(s.get("tensor_bytes")))
        t.add_row("live tensor storages", str(s.get("tensor_storages")))
        t.add_row("process RSS", _fmt_bytes(s.get("rss")))
        t.add_row("process peak RSS", _fmt_bytes(s.get("max_rss")))
        parts.append(t)
        parts.append(Text("Not known on CPU:\n" + "".join(f"  - {u}\n" for u in s.get("unknown", [])), style="dim"))
        return Printable(parts)
    t = _table(f"Caching allocator on {s['device']}", "figure", "value", right=("value",))
    rows = [
        ("allocated", _fmt_bytes(s["allocated"])), ("max allocated", _fmt_bytes(s["max_allocated"])),
        ("reserved", _fmt_bytes(s["reserved"])), ("max reserved", _fmt_bytes(s["max_reserved"])),
        ("fragmentation (1 - allocated/reserved)", f"{s['fragmentation']:.1%}"),
        ("free-cache fragmentation (1 - largest free/free)", f"{s['free_fragmentation']:.1%}"),
        ("largest free block", _fmt_bytes(s["largest_free_block"])),
        ("cached free bytes", _fmt_bytes(s["cached_free"])),
        ("device used / total", f"{_fmt_bytes(s['device_used'])} / {_fmt_bytes(s['device_total'])}"),
        ("allocations so far", str(s["allocs"])),
        ("alloc retries / OOMs", f"{s['num_alloc_retries']} / {s['num_ooms']}"),
        ("expandable segments", "on" if s["expandable_segments"] else "off"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    parts.append(t)
    t = _table("Pools", "pool", "segments", "reserved", "used blocks", "used", "free blocks", "free",
               right=("segments", "reserved", "used blocks", "used", "free blocks", "free"))
    for name, p in sorted(s["pools"].items()):
        t.add_row(name, str(p["segments"]), _fmt_bytes(p["segment_bytes"]), str(p["used"]), _fmt_bytes(p["used_bytes"]),
                  str(p["free"]), _fmt_bytes(p["free_bytes"]))
    parts.append(t)
    t = _table("Block sizes", "size", "used blocks", "used", "free blocks", "free",
               right=("used blocks", "used", "free blocks", "free"))
    for b in s["distribution"]:
        t.add_row(b["bucket"], str(b["used"]), _fmt_bytes(b["used_bytes"]), str(b["free"]), _fmt_bytes(b["free_bytes"]))
    parts.append(t)
    return Printable(parts)


# ---- gradtrace memory ---------------------------------------------------------------------------------
