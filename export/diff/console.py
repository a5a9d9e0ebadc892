"""``diff`` and ``diff_ranks`` results printed on a terminal: the verdict first, then tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from rich.console import Console
from rich.table import Table
from rich.text import Text

from export.diff.elements import STATS_WORDS
from export.text import format_stack, frame_text, short_path
from tracer.model import Frame, Trace
from tracer.model.display import format_number, plural
from tracer.model.frames import fold_label, fold_runs, folded, user_frame

if TYPE_CHECKING:  # the results call these from their render(): no import back at run time
    from export.diff.ranks import RankDiffResult
    from export.diff.result import Compared, DiffResult, Divergence, ParamDiff, Row

_MAX_ROWS = 30
# Modules in the per-module table: where every module differs (runs that parted earlier) the
# table is a list of the model; --json and the HTML page have every one.
_MAX_MODULES = 12
_BASIS = {"stats": "stats", "values": "values", "mixed": "stats+values"}
# A record whose checksums differ while every recorded stat is equal: no number to show.
CHECKSUM_ONLY = "checksum only"
# A module whose records' outputs differ in shape: a difference no number measures.
SHAPES_DIFFER = "shapes differ"


def _tx(s: object, style: str = "") -> Text:  # plain text: names and code may contain [brackets]
    return Text("" if s is None else str(s), style=style)


def render_diff(result: DiffResult, console: Console, *, all_frames: bool = False) -> None:
    """Print a ``DiffResult``: the verdict, notes, the summary table, each origin with both stacks
    (folded as ``gradtrace show`` folds them), insertions and removals with their line, the
    per-module table and the parameters that differ, one line each."""
    console.print(_tx(result.verdict(), "bold green" if result.equal else "bold red"))
    for n in result.notes + result.forward.notes + result.backward.notes:
        console.print(_tx(f"note: {n}", "dim"))
    console.print(_tx(f"A: {result.a_label}   B: {result.b_label}", "dim"))
    for side, report in result.numerics().items():
        if report.headline is not None:  # each side's NaN/Inf story, in the words of every surface
            console.print(_tx(f"{side}: {report.headline_text()}", "red" if report.skipped_step is None else "yellow"))
    _summary_table(result, console)
    for d in (result.forward, result.backward):
        if d.origin is not None:
            _origin(d, d.origin, console, all_frames)
        _structural(result, d, console)
    _module_table(result, console)
    _param_table(result, console)


def _mod(m: str) -> str:
    return m or "<root>"


def _summary_table(result: DiffResult, console: Console) -> None:
    t = Table(title="Summary", title_justify="left")
    for col in ("section", "compared", "differing", "inserted", "removed", "verdict"):
        t.add_column(col, justify="left" if col in ("section", "verdict") else "right", overflow="fold")
    for d in (result.forward, result.backward):
        phases = d.phase_counts()
        if len(phases) < 2:  # one phase (or none): the section's row, named as the headline names it
            c = phases[0] if phases else None
            differing = sum(1 for r in d.rows if r.differs)
            t.add_row(_tx(d.label if c is None or c.phase == d.section else c.phase), _tx(d.compared),
                      _tx(differing), _tx(len(d.inserted)), _tx(len(d.removed)), _tx(d.summary()),
                      style=None if d.equal and not d.from_backward else "red")
            continue
        # Calls of several phases (forward, the optimizer's, ...): a row each, counting only the
        # calls it names, as the headline's word for them (``optimizer``) promises.
        for c in phases:
            same = not (c.differing or c.inserted or c.removed)
            t.add_row(_tx(c.phase), _tx(c.compared), _tx(c.differing), _tx(c.inserted), _tx(c.removed),
                      _tx(d.phase_summary(c)), style=None if same else "red")
    # Parameters and buffers each on their row: a count of one is no count of the other. Those
    # only one trace has were not compared: inserted (only in B) and removed (only in A), never
    # in "compared" or "differing".
    for kind, buffer in (("parameters", False), ("buffers", True)):
        n = state_counts(result.params, buffer)
        if buffer and not (n.compared or n.only_in_a or n.only_in_b or n.reshaped):
            continue
        bad = [p for p in result.differing_params if p.buffer == buffer and p.only_in is None
               and not p.value.shapes_differ]
        words = [f"{state_count(bad)} {'differs' if len(bad) == 1 else 'differ'} ({differing_parts(bad)})"
                 if bad else "equal" if n.compared else ""]
        one_side = n.only_in_a or n.only_in_b or n.reshaped
        if one_side:
            words.append(only_in_words(n))
        t.add_row(_tx(kind), _tx(n.compared), _tx(n.differing), _tx(n.only_in_b if one_side else ""),
                  _tx(n.only_in_a if one_side else ""), _tx("; ".join(w for w in words if w)),
                  style="red" if bad or one_side else None)
    console.print(t)


def _origin(d: Divergence, o: Row, console: Console, all_frames: bool) -> None:
    """The origin's facts side by side, then its stack in each trace, folded as ``gradtrace show``
    folds it unless ``all_frames``."""
    s = Table(title=f"First {d.label} divergence: {d.reason}", title_justify="left", show_lines=True)
    s.add_column("")
    s.add_column("A", overflow="fold")
    s.add_column("B", overflow="fold")
    s.add_row(_tx("record"), _tx(o.a), _tx(o.b), style="red")
    s.add_row(_tx("module"), _tx(_mod(o.module)), _tx(_mod(o.module)))
    s.add_row(_tx("op"), _tx(o.what), _tx(o.what))
    if o.phase:
        s.add_row(_tx("phase"), _tx(o.phase), _tx(o.phase))
    if o.max_abs is not None or o.elements is not None or o.shapes:
        s.add_row(_tx("difference"), _tx(o.describe()), _tx(""))
    console.print(s)
    same = [(f.file, f.line, f.function) for f in d.stack_a] == [(f.file, f.line, f.function) for f in d.stack_b]
    console.print(Text(format_stack(d.stack_a, f"A: {o.a} (most recent call last):", all_frames=all_frames)),
                  soft_wrap=True)
    if same and d.stack_a:
        console.print(_tx(f"B: {o.b}, the same stack"))
    else:
        console.print(Text(format_stack(d.stack_b, f"B: {o.b} (most recent call last):", all_frames=all_frames)),
                      soft_wrap=True)
    hidden = 0 if all_frames else sum(folded(d.stack_a)) + (0 if same else sum(folded(d.stack_b)))
    if hidden:
        console.print(_tx(f"({plural(hidden, 'frame')} folded: --all-frames shows every frame)", "dim"))


def _structural(result: DiffResult, d: Divergence, console: Console) -> None:
    """Records only one trace has, each with the user's line that made it."""
    shown = [r for r in d.rows if r.status in ("inserted", "removed")][:_MAX_ROWS // 2]
    if not shown:
        return
    s = Table(title=f"{d.section}: inserted in B / removed from A", title_justify="left")
    for col in ("A", "B", "phase", "module", "op", "line"):
        s.add_column(col, overflow="fold")
    for r in shown:
        trace, name = (result.trace_a, r.a) if r.a is not None else (result.trace_b, r.b)
        s.add_row(_tx(r.a or "—"), _tx(r.b or "—"), _tx(r.phase), _tx(_mod(r.module)), _tx(r.what),
                  _tx(record_line(trace, name)), style="yellow")
    extra = len(d.inserted) + len(d.removed) - len(shown)
    if extra > 0:
        s.add_row(_tx(f"… {extra} more"), *[_tx("")] * 5)
    console.print(s)


def record_line(trace: Trace | None, name: str | None) -> str:
    """``train.py:12  h = h * 0.5``: the user's line that made a record (a grad node: the line of
    the call that made it), or ``-``."""
    rec = trace.get(name) if trace is not None and name else None
    f = user_frame(getattr(rec, "stack", ()))
    if f is None:
        return "-"
    return f"{short_path(f.file)}:{f.line}  {f.code}".rstrip()


def _module_table(result: DiffResult, console: Console) -> None:
    mods = result.modules()
    if not mods:
        return
    p = Table(title="Per module", title_justify="left")
    # "of": what max abs / max rel are differences of (stats: of min/max/mean/absmax only).
    for col in ("module", "forward differing", "backward differing", "after backward", "max abs", "max rel", "of"):
        p.add_column(col, justify="left" if col in ("module", "of") else "right")
    for m in mods[:_MAX_MODULES]:
        size = module_size(m)
        of = "" if size[0] == SHAPES_DIFFER else _BASIS.get(m.get("basis") or "", "")  # (no number to be of)
        p.add_row(_tx(_mod(m["module"])), _tx(m["forward"]), _tx(m["backward"]), _tx(m["after_backward"]),
                  _tx(size[0]), _tx(size[1]), _tx(of),
                  style="red" if m["origin"] else None)
    if len(mods) > _MAX_MODULES:
        p.add_row(_tx(f"… {len(mods) - _MAX_MODULES} more modules"), *[_tx("")] * 6)
    console.print(p)


def module_size(m: dict[str, Any]) -> tuple[str, str]:
    """The max abs and max rel cells of a row of ``module_table``: the numbers, ``checksum only``,
    or ``shapes differ`` where outputs differ in shape and nothing else was measured (next to the
    numbers, where something was: a shape mismatch has no number, so it never is the largest)."""
    if m["shapes_differ"] and not m["max_abs"] and not m["max_rel"]:
        return SHAPES_DIFFER, ""
    if m["checksum_only"]:
        return CHECKSUM_ONLY, ""
    ab = format_number(m["max_abs"], 3)
    return (f"{ab}, {SHAPES_DIFFER}" if m["shapes_differ"] else ab), format_number(m["max_rel"], 3)


def compared_cell(c: Compared | None) -> str:
    """One compared tensor in a table cell of one short line: ``equal``, ``0.0996 (rel 0.18)`` (the
    largest difference of the stats), ``0.00031 (rel 0.0057) 1/4096`` (element-wise: how many
    elements differ), ``checksum only``, a shape or dtype mismatch. What the numbers are of is
    said once, under the table (``param_legend``)."""
    if c is None:
        return "-"
    if c.status != "differ":
        return c.status
    if c.mismatch:
        return c.why
    if c.checksum_only:
        return CHECKSUM_ONLY
    size = "" if c.abs is None else f"{format_number(c.abs, 2)} (rel {format_number(c.rel, 2)})"
    if c.basis == "values" and c.elements is not None:
        size = f"{size} {c.elements.differing}/{c.elements.total}".strip()
    if size:
        return size
    return f"differs ({c.why})" if c.why else "differs"


def param_legend(params: list[ParamDiff]) -> str:
    """What the numbers of the parameters' table are, said once for the table."""
    cells = [c for p in params for c in (p.value, p.grad, p.updated) if c is not None and c.status == "differ"]
    bases = {c.basis for c in cells if c.abs is not None and not c.checksum_only and not c.mismatch}
    words = []
    if "values" in bases:
        words.append("element-wise where both traces kept the values (k/n: elements that differ)")
    if bases - {"values"}:
        words.append(f"{'else ' if words else ''}of the stats ({STATS_WORDS})")
    return f"numbers: the largest |Δ| (rel), {', '.join(words)}" if words else ""


def _param_table(result: DiffResult, console: Console) -> None:
    bad = result.differing_params
    if not bad:
        return
    shown = bad[:_MAX_ROWS]
    q = Table(title=f"{states_noun(bad).capitalize()} that differ ({differing_of(bad, result.params)})",
              title_justify="left")
    for col in ("parameter", "value read", "gradient", "after step"):
        q.add_column(col, no_wrap=True, overflow="ellipsis")
    for pd in shown:
        if pd.only_in:
            q.add_row(_tx(pd.name), _tx(f"only in {pd.only_in}"), _tx("-"), _tx("-"))
        else:
            q.add_row(_tx(pd.name), _tx(compared_cell(pd.value)), _tx(compared_cell(pd.grad)),
                      _tx(compared_cell(pd.updated)))
    if len(bad) > _MAX_ROWS:
        q.add_row(_tx(f"… {len(bad) - _MAX_ROWS} more (--json lists every one)"), _tx(""), _tx(""), _tx(""))
    console.print(q)
    legend = param_legend(shown)
    if legend:
        console.print(_tx(legend, "dim"))


def folded_cell(frames: tuple[Frame, ...]) -> str:
    """A stack in a table cell, folded as ``gradtrace show`` folds it: the user's frames and the
    innermost one, each on two lines (``file.py:12 in f`` and its source), every run of other
    frames one line (``… 3 frames folded (2 library, 1 framework)``)."""
    return "\n".join(f"... {fold_label(f)}" if isinstance(f, list) else frame_text(f)
                     for f in fold_runs(frames, folded(frames)))


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
            t.add_row(_tx("stack"), _tx(folded_cell(d.stack)))
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


def differing_parts(params: Sequence[ParamDiff]) -> str:
    """What differs among ``params``, of each one's three comparisons, in their order: ``value``
    (the value the step read; one side only counts too), ``gradient``, ``value after the step``
    (``gradient, value after the step``: the values read were equal)."""
    parts = []
    if any(p.only_in is not None or p.value.status == "differ" for p in params):
        parts.append("value")
    if any(p.grad is not None and p.grad.status == "differ" for p in params):
        parts.append("gradient")
    if any(p.updated is not None and p.updated.status == "differ" for p in params):
        parts.append("value after the step")
    return ", ".join(parts)


def state_count(params: Sequence[ParamDiff]) -> str:
    """``4 parameters``, ``20 parameters and 2 buffers``: what a diff compared by name, counted
    apart (a model's buffers are no parameters)."""
    buffers = sum(1 for p in params if p.buffer)
    own = len(params) - buffers
    if not buffers:
        return plural(own, "parameter")
    if not own:
        return plural(buffers, "buffer")
    return f"{plural(own, 'parameter')} and {plural(buffers, 'buffer')}"


def states_noun(params: Sequence[ParamDiff]) -> str:
    """``parameters``, ``buffers`` or ``parameters and buffers``: what ``params`` hold."""
    buffers = sum(1 for p in params if p.buffer)
    return "buffers" if params and buffers == len(params) else "parameters and buffers" if buffers else "parameters"


class StateCounts(NamedTuple):
    """Parameters (or buffers) of a diff counted by what was done with them: ``compared`` by name,
    the ones both traces have; ``differing`` of those; ``only_in_a``/``only_in_b`` the ones one
    trace alone has, never compared, so in neither count (``buffer``: which kind)."""

    buffer: bool
    compared: int
    differing: int
    only_in_a: int
    only_in_b: int
    # In both traces under one name, of another shape: not one parameter changed but a change of
    # structure (an extra layer widens the next), so in neither count either (as the verdict says).
    reshaped: int = 0


def state_counts(params: Sequence[ParamDiff], buffer: bool) -> StateCounts:
    """``params`` of one kind (``buffer``) counted as ``StateCounts``."""
    own = [p for p in params if p.buffer == buffer]
    both = [p for p in own if p.only_in is None and not p.value.shapes_differ]
    return StateCounts(buffer, len(both), sum(1 for p in both if p.differs),
                       sum(1 for p in own if p.only_in == "A"), sum(1 for p in own if p.only_in == "B"),
                       sum(1 for p in own if p.only_in is None and p.value.shapes_differ))


def only_in_words(*counts: StateCounts) -> str:
    """``2 only in B``, ``1 only in A, 2 only in B``; naming the kind where a diff has buffers:
    ``2 parameters only in B, 1 buffer only in A``."""
    named = any(c.buffer for c in counts)
    out = []
    for c in counts:
        kind = "buffer" if c.buffer else "parameter"
        if c.reshaped:
            out.append(f"{plural(c.reshaped, kind) if named else c.reshaped} of another shape")
        for side, n in (("A", c.only_in_a), ("B", c.only_in_b)):
            if n:
                out.append(f"{plural(n, kind) if named else n} only in {side}")
    return ", ".join(out)


def differing_of(bad: Sequence[ParamDiff], params: Sequence[ParamDiff], verb: str = "") -> str:
    """How many of the ``params`` both traces have differ (``bad``): ``4 of 4`` where there is no
    buffer, else counted apart, ``21 of 21 parameters, 0 of 1 buffer``. Those only one trace has
    were not compared, so they are in neither number: said after them, ``4 of 4 in both traces;
    2 only in B`` (an extra layer in B). ``verb`` (`` differ``) follows the counts it speaks of."""
    has_buffers = any(p.buffer for p in params)
    counts = [state_counts(params, buffer) for buffer in ((False, True) if has_buffers else (False,))]
    out = []
    for c in counts:
        n = sum(1 for p in bad if p.buffer == c.buffer and p.only_in is None and not p.value.shapes_differ)
        if not has_buffers:
            out.append(f"{n} of {c.compared}")
        elif c.compared:
            out.append(f"{n} of {plural(c.compared, 'buffer' if c.buffer else 'parameter')}")
    text = ", ".join(out) or "0 of 0"
    one_side = only_in_words(*counts)
    return f"{text} in both traces{verb}; {one_side}" if one_side else text + verb
