"""``diff`` and ``diff_ranks`` results printed on a terminal: the verdict first, then tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from export.text import frame_text
from tracer.model.display import format_number

if TYPE_CHECKING:  # the results call these from their render(): no import back at run time
    from export.diff.ranks import RankDiffResult
    from export.diff.result import Compared, DiffResult, ParamDiff

_MAX_ROWS = 30
_BASIS = {"stats": "stats", "values": "values", "mixed": "stats+values"}


def _tx(s: object, style: str = "") -> Text:  # plain text: names and code may contain [brackets]
    return Text("" if s is None else str(s), style=style)


def render_diff(result: DiffResult, console: Console) -> None:
    """Print a ``DiffResult``: the verdict, notes, the summary table, each origin with both stacks,
    insertions and removals, the per-module table and the parameters that differ."""

    def mod(m: str) -> str:
        return m or "<root>"

    console.print(_tx(result.verdict(), "bold green" if result.equal else "bold red"))
    for n in result.notes + result.forward.notes + result.backward.notes:
        console.print(_tx(f"note: {n}", "dim"))
    console.print(_tx(f"A: {result.a_label}   B: {result.b_label}", "dim"))
    for side, report in result.numerics().items():
        if report.headline is not None:  # each side's NaN/Inf story, in the words of every surface
            console.print(_tx(f"{side}: {report.headline_text()}", "red" if report.skipped_step is None else "yellow"))

    t = Table(title="Summary", title_justify="left")
    for col in ("section", "compared", "differing", "inserted", "removed", "verdict"):
        t.add_column(col, justify="left" if col in ("section", "verdict") else "right", overflow="fold")
    for d in (result.forward, result.backward):
        differing = sum(1 for r in d.rows if r.differs)
        t.add_row(_tx(d.section), _tx(d.compared), _tx(differing), _tx(len(d.inserted)), _tx(len(d.removed)),
                  _tx(d.summary()), style=None if d.equal and not d.from_backward else "red")
    bad = result.differing_params
    t.add_row(_tx("parameters"), _tx(len(result.params)), _tx(len(bad)), _tx(""), _tx(""),
              _tx(f"{len(bad)} differ (value, gradient or value after the step)" if bad else "equal"),
              style="red" if bad else None)
    console.print(t)

    for d in (result.forward, result.backward):
        o = d.origin
        if o is not None:
            s = Table(title=f"First {d.section} divergence: {d.reason}", title_justify="left", show_lines=True)
            s.add_column("")
            s.add_column("A", overflow="fold")
            s.add_column("B", overflow="fold")
            s.add_row(_tx("record"), _tx(o.a), _tx(o.b), style="red")
            s.add_row(_tx("module"), _tx(mod(o.module)), _tx(mod(o.module)))
            s.add_row(_tx("op"), _tx(o.what), _tx(o.what))
            if o.max_abs is not None or o.elements is not None:
                s.add_row(_tx("difference"), _tx(o.describe()), _tx(""))
            s.add_row(_tx("stack"), _tx("\n".join(frame_text(f) for f in d.stack_a[-6:])),
                      _tx("\n".join(frame_text(f) for f in d.stack_b[-6:])))
            console.print(s)
        shown = [r for r in d.rows if r.status in ("inserted", "removed")][:_MAX_ROWS // 2]
        if shown:
            s = Table(title=f"{d.section}: inserted in B / removed from A", title_justify="left")
            for col in ("A", "B", "module", "op"):
                s.add_column(col, overflow="fold")
            for r in shown:
                s.add_row(_tx(r.a or "—"), _tx(r.b or "—"), _tx(mod(r.module)), _tx(r.what), style="yellow")
            extra = len(d.inserted) + len(d.removed) - len(shown)
            if extra > 0:
                s.add_row(_tx(f"… {extra} more"), _tx(""), _tx(""), _tx(""))
            console.print(s)

    mods = result.modules()
    if mods:
        p = Table(title="Per module", title_justify="left")
        # "of": what max abs / max rel are differences of (stats: of min/max/mean/absmax only).
        for col in ("module", "forward differing", "backward differing", "after backward", "max abs", "max rel", "of"):
            p.add_column(col, justify="left" if col in ("module", "of") else "right")
        for m in mods[:_MAX_ROWS]:
            p.add_row(_tx(mod(m["module"])), _tx(m["forward"]), _tx(m["backward"]), _tx(m["after_backward"]),
                      _tx(format_number(m["max_abs"], 3)), _tx(format_number(m["max_rel"], 3)),
                      _tx(_BASIS.get(m.get("basis") or "", "")), style="red" if m["origin"] else None)
        if len(mods) > _MAX_ROWS:
            p.add_row(_tx(f"… {len(mods) - _MAX_ROWS} more modules"), *[_tx("")] * 6)
        console.print(p)

    if bad:
        q = Table(title=f"Parameters that differ ({len(bad)} of {len(result.params)})", title_justify="left")
        for col in ("parameter", "value", "gradient", "after step"):
            q.add_column(col)
        for pd in bad[:_MAX_ROWS]:
            def cell(c: Compared | None, pd: ParamDiff = pd) -> Text:
                if pd.only_in:
                    return _tx(f"only in {pd.only_in}")
                if c is None:
                    return _tx("-")
                how = c.describe() if c.status == "differ" else ""
                return _tx(f"{c.status} ({how})" if how else c.status)
            q.add_row(_tx(pd.name), cell(pd.value), cell(pd.grad), cell(pd.updated))
        if len(bad) > _MAX_ROWS:
            q.add_row(_tx(f"… {len(bad) - _MAX_ROWS} more"), _tx(""), _tx(""), _tx(""))
        console.print(q)


def render_ranks(result: RankDiffResult, console: Console) -> None:
    """Print a ``RankDiffResult``: the verdict, notes, the first departure with its stack, every
    departure, and what was expected to differ or could not be compared."""
    console.print(_tx(result.verdict(), "bold green" if result.equal else "bold red"))
    for n in result.notes:
        console.print(_tx(f"note: {n}", "dim"))
    for r in result.ranks:
        console.print(_tx(f"rank {r}: {result.labels[r]} ({result.collectives.get(r, 0)} collective calls)", "dim"))
    d = result.first
    if d is not None:
        t = Table(title=f"First departure: rank {d.rank}", title_justify="left", show_lines=True)
        t.add_column("")
        t.add_column("", overflow="fold")
        t.add_row(_tx("record"), _tx(d.record, "red"))
        t.add_row(_tx("kind"), _tx(d.what))
        if d.param:
            t.add_row(_tx("parameter"), _tx(d.param))
        if d.placement:
            t.add_row(_tx("placement"), _tx(d.placement))
        t.add_row(_tx("ranks"), _tx(f"departing: {', '.join(map(str, d.ranks))}; "
                                  f"reference: {', '.join(map(str, d.reference))}"))
        t.add_row(_tx("why"), _tx(d.reason))
        if d.max_abs is not None:
            t.add_row(_tx("largest stat diff"), _tx(format_number(d.max_abs, 3)))
        t.add_row(_tx("call"), _tx(f"{d.call or '-'}  {d.api or ''}"))
        t.add_row(_tx("module"), _tx(d.module or "<root>"))
        if d.carrier:
            t.add_row(_tx("first carried by"), _tx(f"{d.carrier}  {d.carrier_api or ''} ({d.carrier_args or ''})"))
        if d.stack:
            t.add_row(_tx("stack"), _tx("\n".join(frame_text(f) for f in d.stack[-6:])))
        console.print(t)
    if len(result.departures) > 1:
        t = Table(title=f"All departures ({len(result.departures)})", title_justify="left")
        for col in ("rank", "record", "kind", "call", "module", "why"):
            t.add_column(col, overflow="fold")
        for x in result.departures[:_MAX_ROWS]:
            t.add_row(_tx(x.rank), _tx(x.record), _tx(x.what), _tx(x.call or "-"), _tx(x.module or "<root>"), _tx(x.reason))
        if len(result.departures) > _MAX_ROWS:
            t.add_row(_tx(f"… {len(result.departures) - _MAX_ROWS} more"), *[_tx("")] * 5)
        console.print(t)
    if result.expected:
        parts = ", ".join(f"{n} {k}" for k, n in sorted(result.expected.items()))
        console.print(_tx(f"expected per-rank differences (not errors): {parts}", "dim"))
    if result.not_comparable:
        parts = ", ".join(f"{n} ({k})" for k, n in sorted(result.not_comparable.items()))
        console.print(_tx(f"not compared, no checksum: {parts}", "dim"))
