"""The canonical compact text form of a trace: one line per call, one per backward step.

    linear3  F.linear  h.0.mlp.c_proj  (clamp0:out, h.0.mlp.c_proj.weight, h.0.mlp.c_proj.bias) -> linear3:out f32[4,32,64] 1a2b3c4d
    backward0  Tensor.backward  (cross_entropy0:out)
    backward0  linear3/AddmmBackward0  <- linear3/ViewBackward0#1:grad0 -> h.0.mlp.c_proj.bias@grad f32[64] 5e6f7a8b, ...

Forward lines come in execution order, indented two spaces per module depth (``h.0.mlp.c_proj``
is depth 4) and two more per enclosing custom ``autograd.Function`` call. The fields are the
call name, its API (``short_api``: ``torch.nn.functional.`` shortened to ``F.``, a script's
``__main__.`` dropped), its module path (``-`` for code outside any module or in the root
module), the input tensors by name and the output tensors as ``name dtype[shape] md5-prefix``. A
tensor without a hash shows ``-``.

After the forward lines, each backward run has a line (name, API, root tensors), then one line
per grad node in the order the engine ran them: the gradients it received (``<-``, by name) and
the ones it produced (``->``, described like forward outputs). A value holding NaN or Inf adds
its counts (``nan=3 inf=0``), and a trace with an anomaly ends with the first line of each
phase's (``first NaN in forward: ...``).

The text depends only on what the program computed: no times, hosts, absolute paths or ids, so
two recordings of the same program give the same text, and tests compare it with inline
expected strings. Calls that raised end in ``!! error``; a trace that did not finish ends with a
``status`` line.

Also here, the small text pieces the terminal views share: stats, stacks and frames.
Names, shapes, dtypes and numbers are written with ``tracer.model.display``.
"""

from __future__ import annotations

import os

from tracer.model import Call, Frame, Stats, TensorRecord, Trace
from tracer.model.display import (  # (re-exported: export's text pieces)
    format_number,
    inert,
    inert_lines,
    module_depth,
    shape_compact,
    short_api,
    short_dtype,
)
from tracer.model.frames import stack_lines

HASH_CHARS = 8


# ---- tensors -----------------------------------------------------------------------------------------
def short_hash(rec: TensorRecord) -> str:
    return rec.md5[:HASH_CHARS] if rec.md5 else "-"


def describe_tensor(trace: Trace, name: str | None, *, hashes: bool = True) -> str:
    """``name f32[2,3,8] 1a2b3c4d`` (the hash part only when ``hashes``)."""
    if name is None:
        return "-"
    rec = trace.tensors.get(name)
    if rec is None:  # a name the trace lost (a truncated file): keep the name alone
        return inert(name)
    text = f"{inert(name)} {inert(short_dtype(rec.dtype))}{shape_compact(rec.shape)}"
    if hashes:
        text += " " + short_hash(rec)
    stats = rec.stats
    if stats is not None and (stats.nan or stats.inf):  # (finite values read as before)
        text += f" nan={stats.nan} inf={stats.inf}"
    return text


def stats_text(stats: Stats | None) -> str:
    """``min -1  max 2.5  mean 0.25`` (and the NaN/Inf counts when there are any)."""
    if stats is None:
        return "-"
    text = (f"min {format_number(stats.min)}  max {format_number(stats.max)}  "
            f"mean {format_number(stats.mean)}")
    if stats.nan or stats.inf:
        text += f"  nan {stats.nan}  inf {stats.inf}"
    return text


def compact_stats(stats: Stats | None) -> str:
    """``[-1, 2.5] 0.25``: [min, max] mean, for a table cell."""
    if stats is None:
        return "-"
    text = f"[{format_number(stats.min)}, {format_number(stats.max)}] {format_number(stats.mean)}"
    if stats.nan or stats.inf:
        text += f" nan {stats.nan} inf {stats.inf}"
    return text


# ---- stacks ------------------------------------------------------------------------------------------
def short_path(path: str) -> str:
    """A path relative to the current directory when it lies inside it (shorter to read)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if rel.startswith("..") else rel


def format_stack(frames: tuple[Frame, ...], title: str = "Stack (most recent call last):", *,
                 all_frames: bool = True) -> str:
    """A stack as Python prints a traceback: ``File "x", line N, in f`` and the source line; unless
    ``all_frames``, only the user's frames and the innermost one, the rest folded
    (``tracer.model.frames``). Every line is inert text (the frames come from a trace file)."""
    title = inert(title)
    if not frames:
        return f"{title}\n  (no stack recorded)"
    return "\n".join([title, *(inert(line) for line in stack_lines(frames, all_frames))])


def call_site(frames: tuple[Frame, ...]) -> str:
    """The innermost frame as ``path:line  code`` (the line that made the record)."""
    if not frames:
        return "-"
    f = frames[-1]
    return inert(f"{short_path(f.file)}:{f.line}  {f.code}".rstrip())


def frame_text(f: Frame) -> str:
    """One frame on two lines, ``file.py:12 in f`` and the source line (a table cell)."""
    return f"{inert(os.path.basename(f.file))}:{f.line} in {inert(f.function)}\n  {inert(f.code)}"


# ---- the whole trace ---------------------------------------------------------------------------------
def function_depth(call: Call, calls: dict[str, Call]) -> int:
    """How many custom Function calls enclose this call (a grad node parent ends the chain)."""
    depth = 0
    seen: set[str] = set()
    parent = call.parent
    while parent is not None and parent in calls and parent not in seen:
        seen.add(parent)
        depth += 1
        parent = calls[parent].parent
    return depth


def call_line(trace: Trace, call: Call, calls: dict[str, Call], *, hashes: bool = True) -> str:
    indent = "  " * (module_depth(call.module) + function_depth(call, calls))
    outs = ", ".join(describe_tensor(trace, o, hashes=hashes) for o in call.outputs) or "-"
    line = (f"{indent}{call.name}  {short_api(call.api)}  {call.module or '-'}  "
            f"({', '.join(call.inputs)}) -> ")
    if call.phase == "backward" and (call.parent is None or call.parent not in calls):
        # Made by a grad node's own code; a call nested in another call shows by its indent.
        tail = f"  [in backward of {call.parent}]" if call.parent else "  [in backward]"
    else:
        tail = ""
    if call.error:
        tail += f"  !! {call.error}"
    return inert(line) + outs + inert(tail)


def _names(names: list[str | None]) -> str:
    return inert(", ".join("-" if n is None else n for n in names) or "-")


def to_text(trace: Trace, *, hashes: bool = True, backward: bool = True) -> str:
    """The whole trace as canonical text (ends with a newline unless the trace is empty)."""
    calls = {c.name: c for c in trace.calls}
    lines = [call_line(trace, c, calls, hashes=hashes) for c in sorted(trace.calls, key=lambda c: c.seq)]
    if backward:
        for run in sorted(trace.backward_runs, key=lambda b: b.seq):
            head = inert(f"{run.name}  {run.api}  ({', '.join(run.roots)})")
            if run.outputs:
                head += " -> " + ", ".join(describe_tensor(trace, o, hashes=hashes) for o in run.outputs)
            if run.status != "ok":
                head += inert(f"  !! {run.status}: {run.error or ''}".rstrip())
            lines.append(head)
            for step in run.steps:
                outs = ", ".join(describe_tensor(trace, g, hashes=hashes) for g in step.grads_out) or "-"
                lines.append(f"{inert(run.name)}  {inert(step.node)}  <- {_names(step.grads_in)} -> {outs}")
    report = trace.anomalies
    if not report.clean:  # the story's headline and what it reached (gradtrace summary says more)
        lines.append(inert(report.headline_text()))
        if report.spread.count:
            lines.append(inert("  " + report.spread.line()))
    if trace.status != "ok":
        err = trace.error or {}
        detail = f": {err.get('type', '')}: {err.get('message', '')}" if err else ""
        lines.append(inert(f"status {trace.status}{detail}"))
    return "".join(line + "\n" for line in lines)


__all__ = ["HASH_CHARS", "call_line", "call_site", "compact_stats", "describe_tensor", "format_stack", "frame_text",
           "function_depth", "inert", "inert_lines", "short_hash", "short_path", "stats_text", "to_text"]
