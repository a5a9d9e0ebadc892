"""Terminal views of a trace: what ``gradtrace summary``, ``gradtrace show`` and ``gradtrace md5``
print (the commands are in ``export.cli.summary``).

``render_summary`` prints a header (status, versions, counts, parameters), the most called APIs,
the calls and grad nodes of each top-level module, the backward runs with the user's line that
started them, and every tensor whose stats counted a NaN or an Inf (in red).

``render_record`` (``show``) prints one record (call, tensor, grad node or backward run) with all
its fields and its links, and its call stack the way Python prints a traceback.

``md5_lines`` gives ``name:md5`` per tensor in creation order and nothing else, for shell diffs.

Colours appear only on a terminal; piped output is plain text, 120 columns wide, so it is the
same from run to run.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from export.errors import UserError
from export.text import call_site, compact_stats, format_stack, inert, inert_lines, stats_text
from export.views import checksum, module_groups, module_with_class, nonfinite, param_totals
from tracer.analysis.numerics import OptimizerStep, optimizer_steps
from tracer.model import BackwardRun, Call, Frame, GradNode, TensorRecord, Trace
from tracer.model.display import (
    clip,
    format_bytes,
    format_number,
    plural,
    shape_compact,
    short_api,
    short_dtype,
)
from tracer.model.frames import folded, short_line, user_frame
from tracer.model.gradients import summed_from
from tracer.model.phases import replaces_whole, stepped_with_closure
from tracer.model.records import PHASES

TOP_APIS = 15
MAX_ROWS = 40
MAX_EDITS = 16  # in-place edits of a gradient followed back to the sum of a step's runs
MAX_WHY_NOT = 4  # reasons named on the "without stats" line; the rest are counted as "other"


def _add_row(table: Table, *cells: Any, style: str | None = None) -> None:
    # Cells come from the trace file: each shows on its own row, with control characters escaped
    # (a newline in a name would otherwise make a second row).
    table.add_row(*(Text(inert(c)) if isinstance(c, str) else c for c in cells), style=style)


# ---- summary ---------------------------------------------------------------------------------------
def render_summary(trace: Trace, console: Console, *, all_anomalies: bool = False, all_frames: bool = False) -> None:
    """Print the summary of a trace on a rich console; ``all_anomalies``: every module a NaN/Inf
    reached, ``all_frames``: every frame of the anomalies' stacks."""
    _render_header(trace, console)
    _render_apis(trace, console)
    _render_modules(trace, console)
    _render_backward(trace, console)
    _render_phases(trace, console)
    _render_nonfinite(trace, console, all_anomalies, all_frames)


def _render_header(trace: Trace, console: Console) -> None:
    h = trace.header
    status_style = "green" if trace.status == "ok" else "bold red"
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    if "step" in h:
        _add_row(grid, "step", str(h["step"]))
    _add_row(grid, "status", Text(trace.status, style=status_style))
    _add_row(grid, "torch", str(h.get("torch", "?")))
    _add_row(grid, "gradtrace", str(h.get("gradtrace", "?")))
    _add_row(grid, "hash", trace.hash_algorithm)
    _add_row(grid, "records", f"{plural(len(trace.calls), 'call')}, {plural(len(trace.grad_nodes), 'grad node')}, "
                            f"{plural(len(trace.tensors), 'tensor')}, "
                            f"{plural(len(trace.backward_runs), 'backward run')}")
    n_params, numel, nbytes = param_totals(trace)
    _add_row(grid, "parameters", f"{plural(numel, 'element')} in {plural(n_params, 'tensor')} "
                                 f"({format_bytes(nbytes)})")
    root = trace.modules.get("")
    _add_row(grid, "module", root if root is not None else "-")
    if trace.error:
        err = trace.error
        last = f" (last call {err['last_call']})" if err.get("last_call") else ""
        _add_row(grid, "error", Text(inert_lines(f"{err.get('type', '')}: {err.get('message', '')}{last}"), style="red"))
    for note in trace.notes:
        _add_row(grid, "note", note)
    console.print(grid)


def _render_apis(trace: Trace, console: Console) -> None:
    counts = Counter(c.api for c in trace.calls)
    nodes: Counter[str] = Counter()
    for c in trace.calls:
        nodes[c.api] += len(c.grad_nodes)
    table = Table(title=f"Top APIs by calls ({len(counts)} distinct)", box=box.SIMPLE_HEAD,
                  title_justify="left")
    table.add_column("API")
    table.add_column("calls", justify="right")
    table.add_column("grad nodes", justify="right")
    for api, n in counts.most_common(TOP_APIS):
        _add_row(table, short_api(api), str(n), str(nodes[api]))
    if len(counts) > TOP_APIS:
        rest = counts.total() - sum(n for _, n in counts.most_common(TOP_APIS))
        _add_row(table, f"... {plural(len(counts) - TOP_APIS, 'more API', 'more APIs')}", str(rest), "", style="dim")
    console.print(table)


def _render_modules(trace: Trace, console: Console) -> None:
    group = module_groups([c.module for c in trace.calls])
    calls: Counter[str] = Counter()
    nodes: Counter[str] = Counter()
    for c in trace.calls:
        key = group[c.module]
        calls[key] += 1
        nodes[key] += len(c.grad_nodes)
    table = Table(title="Modules", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("module")
    table.add_column("class")
    table.add_column("calls", justify="right")
    table.add_column("grad nodes", justify="right")
    for key, n in calls.items():  # first-seen order: the order the model ran
        # Call.module is '' both in the root module and outside every module (the optimizer).
        label = key if key else "(root module or outside modules)"
        _add_row(table, label, trace.modules.get(key, "-") if key else "-", str(n), str(nodes[key]))
    console.print(table)


def _render_backward(trace: Trace, console: Console) -> None:
    if not trace.backward_runs:
        console.print("No backward runs.")
        return
    table = Table(title="Backward runs", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("run")
    table.add_column("api")
    table.add_column("nodes run", justify="right")
    table.add_column("status")
    table.add_column("called from", overflow="fold")
    for run in trace.backward_runs:
        status = Text(run.status, style="green" if run.status == "ok" else "red")
        _add_row(table, run.name, run.api, str(len(run.steps)), status, call_site(run.stack))
    console.print(table)


def _render_phases(trace: Trace, console: Console) -> None:
    """What each phase of the step holds (tracer.model.phases): its calls, first to last; the
    forward's steps and micro-batches; the backward's runs; the optimizer phase's optimizer steps."""
    table = Table(title="Phases", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("phase")
    table.add_column("calls", justify="right")
    table.add_column("first", overflow="fold")
    table.add_column("last", overflow="fold")
    table.add_column("", overflow="fold")
    # (a step with a closure evaluates it, forward and backward, several times: not micro-batches)
    closure = stepped_with_closure(trace)
    steps, tail = optimizer_steps(trace)
    for phase in PHASES:
        calls = [c for c in trace.calls if c.phase == phase]
        if phase == "backward":
            note = plural(len(trace.backward_runs), "backward run")
        elif phase == "forward":
            note = "" if closure else _steps_text(trace, steps, tail)
        else:
            note = ", ".join(c.name for c in calls if c.kind == "optimizer") or (
                "a step with a closure: its ops one by one" if closure
                else "no optimizer step: GradScaler skipped " + ("it" if len(steps) == 1 else f"all {len(steps)}")
                if steps and all(s.end.kind != "optimizer" for s in steps) else "no optimizer step")
        _add_row(table, phase, str(len(calls)), calls[0].name if calls else "-", calls[-1].name if calls else "-", note)
    console.print(table)


def _steps_text(trace: Trace, steps: list[OptimizerStep], tail: list[BackwardRun]) -> str:
    """The steps of the block and the backward runs of each: ``3 steps``, ``1 step of 4
    micro-batches``, ``2 steps, 2 micro-batches each``; runs are micro-batches where the step
    summed their gradients into ``.grad`` (gradient accumulation), else ``backward runs`` (SAM's
    second pass after zero_grad); none for one step of one run."""
    if not steps:  # no optimizer step: the block's runs, as micro-batches where they accumulate
        return f"{len(tail)} micro-batches" if len(tail) > 1 and _accumulated(trace, None) else ""
    counts = [len(s.runs) for s in steps]
    several = [s for s in steps if len(s.runs) > 1]
    word = "micro-batches" if all(_accumulated(trace, s.end) for s in several) else "backward runs"
    if len(steps) == 1:
        text = f"1 step of {counts[0]} {word}" if counts[0] > 1 else "1 step"
    elif max(counts) == 1:
        text = f"{len(steps)} steps"
    elif min(counts) == max(counts):
        text = f"{len(steps)} steps, {counts[0]} {word} each"
    else:
        text = f"{len(steps)} steps, {min(counts)} to {max(counts)} {word} each"
    if tail:
        return f"{text}, then {plural(len(tail), 'backward run')} with no step"
    return "" if text == "1 step" else text


def _accumulated(trace: Trace, end: Call | None) -> bool:
    """Whether a gradient that ``end`` (the call that ended a step; None: any) reads is a sum the
    engine made of two backward runs' gradients: ``w@grad@v1``, the first run's ``w@grad`` plus
    the second's, edited in place or not since (clipping, GradScaler's unscale). Not after a
    reset: SAM's second pass after ``zero_grad()`` writes a fresh ``w@grad#1``, or adds into the
    zeroed ``.grad`` (the sum's previous value a call's)."""
    for name in end.inputs if end is not None else list(trace.tensors):
        t = trace.tensors.get(name)
        for _ in range(MAX_EDITS):  # back through the edits in place after the runs
            made_by = trace.get(t.producer) if t is not None and t.producer else None
            if t is None or t.previous is None or not isinstance(made_by, Call) or made_by.phase == "backward" \
                    or replaces_whole(made_by.api):
                break
            t = trace.tensors.get(t.previous)
        if t is None or t.previous is None or not (t.producer or "").endswith("/AccumulateGrad"):
            continue
        before = trace.tensors.get(t.previous)
        made_by = trace.get(before.producer) if before is not None and before.producer else None
        if isinstance(made_by, GradNode | BackwardRun) or (isinstance(made_by, Call) and made_by.phase == "backward"):
            return True
    return False


def _render_nonfinite(trace: Trace, console: Console, all_anomalies: bool, all_frames: bool) -> None:
    with_stats = [t for t in trace.tensors_in_order() if t.stats is not None]
    bad = nonfinite(trace)
    if not with_stats:
        console.print("No tensor stats recorded (NaN/Inf check not available).")
        return
    if not bad:
        # A file of several steps: the verdict is this step's (the list of steps says the others').
        of_step = f" of step {trace.header['step']}" if "step" in trace.header else ""
        console.print(f"No NaN or Inf in the {plural(len(with_stats), 'tensor')} with stats{of_step}.")
        _render_without_stats(trace, console)
        return
    # The verdict first, in the numerics report's words (its headline is never an intended Inf).
    report = trace.anomalies
    fault = report.headline is not None and report.skipped_step is None
    console.print(Text(inert_lines(report.describe(all_anomalies, all_frames)), style="bold red" if fault else "yellow"),
                  soft_wrap=True)
    # The values the story counts, in the order they were met; intended Infs and dropped values
    # are counted under the table, not listed in it.
    counted = [trace.tensors[n] for n in report.nonfinite_values if n in trace.tensors]
    if counted:
        table = Table(title=f"Values with NaN or unintended Inf ({len(counted)} of {len(with_stats)} with stats)",
                      box=box.SIMPLE_HEAD, title_justify="left", title_style="bold red" if fault else "yellow")
        for col in ("tensor", "shape", "dtype", "role", "producer"):
            table.add_column(col)
        table.add_column("nan", justify="right")
        table.add_column("inf", justify="right")
        for t in counted[:MAX_ROWS]:
            assert t.stats is not None
            _add_row(table, t.name, shape_compact(t.shape), t.dtype, t.role, t.producer or "-",
                     str(t.stats.nan), str(t.stats.inf), style="red" if fault else None)
        if len(counted) > MAX_ROWS:
            _add_row(table, f"... {len(counted) - MAX_ROWS} more", "", "", "", "", "", "", style="dim")
        console.print(table)
    rest = len(bad) - len(counted)
    if rest > 0:
        console.print(Text(f"{plural(rest, 'other value')} with NaN or Inf not listed: intended Infs (-inf masks) "
                           "and values no later value keeps", style="dim"))
    _render_without_stats(trace, console)


def _render_story_of(trace: Trace, name: str, console: Console) -> None:
    """Where a record stands in the step's NaN/Inf story, when it has a part in it."""
    report = trace.anomalies
    h = report.headline
    if h is None:
        return
    if name in (h.producer, h.tensor):
        console.print(Text(inert("numerics: the headline of this step — " + report.headline_text()), style="bold red"),
                      soft_wrap=True)
    elif name in report.nonfinite_values:
        console.print(Text(inert(f"numerics: holds NaN/Inf reached from {h.producer} — {report.headline_text()}"),
                           style="red"), soft_wrap=True)


def _render_without_stats(trace: Trace, console: Console) -> None:
    """Say which tensors the NaN/Inf verdict could not look at, and why: the header counts every
    tensor, the verdict only those with stats (``8 tensors without stats: 8 empty``)."""
    why = Counter(_why_no_stats(t) for t in trace.tensors.values() if t.stats is None)
    if not why:
        return
    named = why.most_common(MAX_WHY_NOT)
    parts = [f"{n:,} {reason}" for reason, n in named]
    if len(why) > MAX_WHY_NOT:
        parts.append(f"{why.total() - sum(n for _, n in named):,} other")
    console.print(Text(inert(f"{plural(why.total(), 'tensor')} without stats: {', '.join(parts)}.")))


def _why_no_stats(t: TensorRecord) -> str:
    """Why a tensor has no stats, in a few words; a hash note (from the file) clipped to its gist."""
    if t.uninitialized:
        return "uninitialised"
    if t.hash_note:
        gist = t.hash_note.removeprefix("not hashed: ").split("(")[0].split(";")[0]
        return f"not hashed ({clip(gist.strip() or t.hash_note, 40)})"
    if 0 in t.shape:
        return "empty"
    return "no stats recorded"


# ---- show ------------------------------------------------------------------------------------------
def lookup(trace: Trace, name: str) -> Any:
    try:
        return trace[name]
    except KeyError as exc:
        raise UserError(str(exc.args[0]) if exc.args else f"no record named {name!r}") from None


def render_record(trace: Trace, name: str, console: Console, *, all_frames: bool = False) -> None:
    """Print one call, tensor, grad node or backward run with its links and stack (the user's
    frames and the innermost one, the rest folded, unless ``all_frames``)."""
    rec = lookup(trace, name)
    if isinstance(rec, Call):
        _show_call(trace, rec, console, all_frames)
    elif isinstance(rec, TensorRecord):
        _show_tensor(trace, rec, console, all_frames)
    elif isinstance(rec, GradNode):
        _show_node(trace, rec, console, all_frames)
    elif isinstance(rec, BackwardRun):
        _show_run(trace, rec, console, all_frames)
    if isinstance(rec, Call | TensorRecord | GradNode):
        _render_story_of(trace, rec.name, console)


def _fields(console: Console, title: str, rows: list[tuple[str, Any]]) -> None:
    console.print(Text(inert(title), style="bold"))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="cyan")
    grid.add_column(overflow="fold")
    for key, value in rows:
        _add_row(grid, key, value if isinstance(value, Text) else str(value))
    console.print(grid)


def _tensor_table(trace: Trace, title: str, names: list[str | None]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("tensor", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    table.add_column("dtype", no_wrap=True)
    table.add_column("md5", no_wrap=True)
    table.add_column("stats [min, max] mean", overflow="fold")
    for i, name in enumerate(names):
        if name is None:
            _add_row(table, str(i), "-", "", "", "", "no gradient", style="dim")
            continue
        t = trace.tensors.get(name)
        if t is None:
            _add_row(table, str(i), name, "?", "?", "-", "not in trace")
            continue
        md5 = t.md5 or (t.hash_note or "-")
        style = "red" if t.stats is not None and not t.stats.finite else None
        _add_row(table, str(i), name, shape_compact(t.shape), short_dtype(t.dtype), md5, compact_stats(t.stats),
                      style=style)
    return table


def _module_text(trace: Trace, module: str) -> str:
    return module_with_class(trace, module, outside="(outside modules)")


def _describe_producer(trace: Trace, producer: str | None, tensor: str = "") -> str:
    summed = summed_from(trace, tensor) if tensor else []
    if summed:  # tied weights, a tensor used twice: the engine's sum of several edges
        return (f"sum of {plural(len(summed), 'gradient')}: "
                + ", ".join(f"{e.name} (from {e.node})" if e.name.split(":")[0] != e.node else e.name
                            for e in summed))
    if producer is None:
        return "- (made outside the traced block)"
    rec = trace.get(producer)
    if isinstance(rec, Call):
        return f"{producer}  (call {rec.api})"
    if isinstance(rec, GradNode):
        return f"{producer}  (grad node {rec.kind})"
    if isinstance(rec, BackwardRun):
        return f"{producer}  (backward run {rec.api})"
    return producer


def _print_stack(console: Console, frames: tuple[Frame, ...], all_frames: bool,
                 title: str = "Stack (most recent call last):") -> None:
    # soft_wrap: long paths and source lines stay on one line, as in a real traceback.
    console.print(Text(format_stack(frames, title, all_frames=all_frames)), soft_wrap=True)
    hidden = 0 if all_frames else sum(folded(frames))
    if hidden:
        noun = "frame" if hidden == 1 else "frames"
        console.print(Text(f"({hidden} {noun} folded: --all-frames shows every frame)", style="dim"))


def _show_call(trace: Trace, call: Call, console: Console, all_frames: bool) -> None:
    rows: list[tuple[str, Any]] = [
        ("api", call.api), ("kind", call.kind), ("phase", call.phase),
        ("module", _module_text(trace, call.module)), ("args", call.args or "-"),
        ("parent", call.parent or "-"), ("seq", call.seq),
    ]
    if call.mutated:
        rows.append(("changed in place", ", ".join(call.mutated)))
    if call.error:
        rows.append(("error", Text(inert_lines(call.error), style="red")))
    _fields(console, f"call {call.name}", rows)
    console.print(_tensor_table(trace, "inputs", list(call.inputs)))
    console.print(_tensor_table(trace, "outputs", list(call.outputs)))
    if call.grad_nodes:
        table = Table(title="grad nodes", box=box.SIMPLE_HEAD, title_justify="left")
        table.add_column("node")
        table.add_column("kind")
        table.add_column("next", overflow="fold")
        for n in call.grad_nodes:
            node = trace.get(n)
            nxt = ", ".join("-" if x is None else x for x in node.next) if isinstance(node, GradNode) else "?"
            _add_row(table, n, node.kind if isinstance(node, GradNode) else "?", nxt or "-")
        console.print(table)
    nested = [c for c in trace.calls if c.parent == call.name]
    if nested:
        console.print(Text("nested calls: ", style="bold") + Text(inert(", ".join(c.name for c in nested))))
    _print_stack(console, call.stack, all_frames)


def _show_tensor(trace: Trace, t: TensorRecord, console: Console, all_frames: bool) -> None:
    newer = [x.name for x in trace.tensors_in_order() if x.previous == t.name]
    rows: list[tuple[str, Any]] = [
        ("shape", shape_compact(t.shape)), ("dtype", t.dtype), ("device", t.device), ("role", t.role),
        ("producer", _describe_producer(trace, t.producer, t.name)),
        ("stride", "-" if t.stride is None else shape_compact(t.stride)),
        ("contiguous", t.contiguous), ("requires_grad", t.requires_grad), ("version", t.version),
        ("seq", t.seq), ("previous", t.previous or "-"), ("next version", ", ".join(newer) or "-"),
        ("md5", t.md5 or "-"),
    ]
    if t.hash_note:
        rows.append(("hash note", t.hash_note))
    if t.fingerprint:
        rows.append(("fingerprint", t.fingerprint))
    style = "red" if t.stats is not None and not t.stats.finite else ""
    rows.append(("stats", Text(stats_text(t.stats), style=style)))
    if t.stats is not None:
        rows.append(("absmax", format_number(t.stats.absmax)))
    _fields(console, f"tensor {t.name}", rows)

    table = Table(title="consumers", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("by")
    table.add_column("what")
    table.add_column("module / run", overflow="fold")
    for c in trace.calls:
        if t.name in c.inputs:
            _add_row(table, c.name, c.api, _module_text(trace, c.module))
    for run in trace.backward_runs:
        if t.name in run.roots:
            _add_row(table, run.name, f"{run.api} (root)", run.name)
        for step in run.steps:
            if t.name in step.grads_in:
                _add_row(table, step.node, "grad node (received)", run.name)
    console.print(table if table.row_count else Text("consumers: none"))

    producer = trace.get(t.producer) if t.producer else None
    if isinstance(producer, Call | GradNode | BackwardRun):
        _print_stack(console, producer.stack, all_frames, f"Stack of producer {producer.name} (most recent call last):")
    elif summed_from(trace, t.name):
        console.print("Stack: none (the autograd engine summed the gradients above; `show` each for its line)")
    elif t.producer:  # a producer the file lost (cut off before its record)
        console.print(Text(inert(f"Stack: unknown (its producer {t.producer} is not in this file"
                                 f"{': the trace was cut off' if trace.status == 'truncated' else ''})")))
    else:
        console.print("Stack: none (the tensor was made outside the traced block)")


def _show_node(trace: Trace, node: GradNode, console: Console, all_frames: bool) -> None:
    call = trace.get(node.call) if node.call else None
    rows: list[tuple[str, Any]] = [
        ("kind", node.kind),
        ("call", f"{node.call}  ({call.api}, module {_module_text(trace, call.module)})"
         if isinstance(call, Call) else (node.call or "-")),
        ("param", node.param or "-"), ("external", node.external), ("seq", node.seq),
    ]
    runs = [f"{run.name} step {i}" for run in trace.backward_runs for i, s in enumerate(run.steps)
            if s.node == node.name]
    lean = trace.header.get("node_runs") is False and node.kind != "AccumulateGrad"
    rows.append(("ran in", ", ".join(runs) or ("- (runs of built-in nodes not recorded: node_runs)" if lean
                                               else "- (not run)")))
    feeders = [n.name for n in trace.grad_nodes if node.name in n.next]
    rows.append(("fed by", ", ".join(feeders) or "-"))
    _fields(console, f"grad node {node.name}", rows)

    table = Table(title="next (one edge per output)", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("next node")
    table.add_column("gradient sent (last run)", overflow="fold")
    for i, dest in enumerate(node.next):
        grad = node.grads_out[i] if i < len(node.grads_out) else None
        _add_row(table, str(i), dest or "- (no edge)", grad or "-")
    if node.next:
        console.print(table)
    if node.grads_in or node.grads_out:
        console.print(_tensor_table(trace, "gradients received (last run)", list(node.grads_in)))
        if node.grads_out:
            console.print(_tensor_table(trace, "gradients produced (last run)", list(node.grads_out)))
    _print_node_calls(trace, node, console)
    _print_stack(console, node.stack, all_frames)


def _print_node_calls(trace: Trace, node: GradNode, console: Console) -> None:
    """The calls the node's own code made when it ran (a custom Function's ``backward()``, a hook,
    recomputation), each with the user's line that made it."""
    made = [c for c in trace.calls if c.parent == node.name]
    if not made:
        return
    table = Table(title="calls its backward made (hooks, custom backward(), recomputation)", box=box.SIMPLE_HEAD,
                  title_justify="left")
    table.add_column("call", no_wrap=True)
    table.add_column("api", no_wrap=True)
    table.add_column("line", overflow="fold")
    for c in made[:MAX_ROWS]:
        line = user_frame(c.stack)
        bad = any((t := trace.tensors.get(o)) is not None and t.stats is not None and not t.stats.finite
                  for o in c.outputs)
        _add_row(table, c.name, c.api, short_line(line) if line else "-", style="red" if bad else None)
    if len(made) > MAX_ROWS:
        _add_row(table, f"... {len(made) - MAX_ROWS} more", "", "", style="dim")
    console.print(table)


def _show_run(trace: Trace, run: BackwardRun, console: Console, all_frames: bool) -> None:
    rows: list[tuple[str, Any]] = [
        ("api", run.api), ("roots", ", ".join(run.roots) or "-"),
        ("status", Text(run.status, style="green" if run.status == "ok" else "red")),
        ("nodes run", len(run.steps)), ("seq", run.seq),
    ]
    if run.outputs:
        rows.append(("outputs", ", ".join(run.outputs)))
    if run.error:
        rows.append(("error", Text(inert_lines(run.error), style="red")))
    _fields(console, f"backward run {run.name}", rows)
    # One line per step rather than a table: gradient names are long and a table would cut them.
    console.print(Text("steps (engine order): node  <- received  -> produced", style="bold"))
    width = len(str(max(len(run.steps) - 1, 0)))
    for i, s in enumerate(run.steps):
        recv = ", ".join(g or "-" for g in s.grads_in) or "-"
        sent = ", ".join(g or "-" for g in s.grads_out) or "-"
        console.print(Text(inert(f"  {i:>{width}}  {s.node}  <- {recv}  -> {sent}")), soft_wrap=True)
    _print_stack(console, run.stack, all_frames)


# ---- md5 -------------------------------------------------------------------------------------------
def md5_lines(trace: Trace) -> list[str]:
    """``name:md5`` per tensor in creation order; ``name:-`` for a tensor that was not hashed."""
    # With hash="fast" the checksum column holds the 64-bit fingerprint instead.
    # One line per tensor whatever its name holds (a newline in a name cannot forge a line).
    return [f"{inert(t.name)}:{checksum(t) or '-'}" for t in trace.tensors_in_order()]


