"""Readable explanations for exceptions raised during a backward run.

PyTorch reports a backward error with the failing node's class at best; ``detect_anomaly`` adds
only the innermost forward traceback. Here every level is named: when the failing node ran inside
another node's backward (a custom Function whose backward calls ``autograd.grad`` on an inner
graph built by another Function, and so on), each level gets its own block, outermost first,
indented one level deeper, with the node's unified name, PyTorch class, the call that created it,
that call's module path and its forward stack (the user's line). The text is attached to the
original exception as a PEP 678 note, so its type, message and traceback stay intact.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from tracer.model import BackwardRun, Call, Frame, GradNode, Trace
from tracer.model.frames import USER, fold_label, frame_class

_INPLACE = re.compile(r"which is output (\d+) of (\w+), is at version (\d+); expected version (\d+)")
INDENT = "    "


def add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: keep the text where 3.11's traceback printer would look
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def _where(stack: tuple[Frame, ...], indent: str) -> list[str]:
    if not stack:
        return [f"{indent}(no forward stack recorded)"]
    def frame(f: Frame) -> list[str]:
        return [f'{indent}File "{f.file}", line {f.line}, in {f.function}', f"{indent}{INDENT}{f.code}"]
    # The innermost frame, and before it the user's innermost line when the call was made inside
    # a library (a transformers model): the frames between them are folded.
    user = [i for i, f in enumerate(stack) if frame_class(f.file) == USER]
    if not user or user[-1] == len(stack) - 1:
        return frame(stack[-1])
    between = stack[user[-1] + 1:-1]
    return [*frame(stack[user[-1]]), *([f"{indent}... {fold_label(between)}"] if between else []), *frame(stack[-1])]


def explain_backward_error(trace: Trace, run: BackwardRun, running: list[str], exc: BaseException,
                           stack_of: Callable[[int | None], tuple[Frame, ...]], unknown_node: bool = False,
                           raised_at: Frame | None = None) -> str:
    """The note for ``exc``: ``running`` lists the grad nodes that were running, outermost first.
    ``unknown_node``: none is known because built-in nodes' runs were not recorded (a trace
    without checksums or stats, ``node_runs=None``). ``raised_at``: where Python code the
    backward ran (a hook, a custom backward) raised it."""
    nodes = {n.name: n for n in trace.grad_nodes}
    calls = {c.name: c for c in trace.calls}
    site = stack_of(run.stack_id)
    where = f' (called at File "{site[-1].file}", line {site[-1].line}: {site[-1].code})' if site else ""
    levels = [nodes[n] for n in running if n in nodes]
    lines: list[str] = []
    if not levels and unknown_node and raised_at is not None:
        lines.append(f"gradtrace: {run.name}{where} failed in Python code it ran (a hook, a custom backward), "
                     f'raised at File "{raised_at.file}", line {raised_at.line}, in {raised_at.function}: '
                     f"{raised_at.code}")
        lines.append(f"{INDENT}{type(exc).__name__}: {_first_line(exc)}")
        return "\n".join(lines)
    if not levels and unknown_node:
        lines.append(f"gradtrace: {run.name}{where} failed in a built-in grad node; which one is not known: "
                     "this trace records built-in nodes' runs only with checksums or stats. "
                     "tracer.explain_errors() or trace(node_runs=True) names it.")
        lines.append(f"{INDENT}{type(exc).__name__}: {_first_line(exc)}")
        return "\n".join(lines)
    if not levels:
        lines.append(f"gradtrace: {run.name}{where} failed before any recorded grad node ran.")
        return "\n".join(lines)
    failing = levels[-1]
    lines.append(f"gradtrace: {run.name}{where} failed in grad node {failing.name} [{failing.kind}].")
    for depth, node in enumerate(levels):
        ind = INDENT * depth
        lines += _level(node, calls, ind, stack_of)
    if len(levels) == 1:  # a node created inside other Functions' forward: show those levels too
        call = calls.get(failing.call or "")
        chain = []
        while call is not None and call.parent in calls:
            call = calls[call.parent]
            chain.append(call)
        for depth, outer in enumerate(chain, start=1):
            ind = INDENT * depth
            lines.append(f"{ind}created inside the forward of {outer.name} ({outer.api}) in module "
                         f"'{outer.module or '<root>'}':")
            lines += _where(stack_of(outer.stack_id), ind + INDENT)
    if raised_at is not None:
        lines.append(f'{INDENT * len(levels)}raised in Python code the backward ran, File "{raised_at.file}", '
                     f"line {raised_at.line}, in {raised_at.function}: {raised_at.code}")
    lines.append(f"{INDENT * len(levels)}{type(exc).__name__}: {_first_line(exc)}")
    inplace = _explain_inplace(trace, failing, calls, str(exc))
    if inplace:
        lines.append(inplace)
    return "\n".join(lines)


def _level(node: GradNode, calls: dict[str, Call], ind: str,
           stack_of: Callable[[int | None], tuple[Frame, ...]]) -> list[str]:
    call = calls.get(node.call or "")
    if call is None:
        who = f"the accumulator of {node.param}" if node.param else "code outside the trace"
        return [f"{ind}Error in backward of {node.name} [{node.kind}], {who}:"]
    head = (f"{ind}Error in backward of {node.name} [{node.kind}], created by {call.name} ({call.api}) "
            f"in module '{call.module or '<root>'}':")
    return [head, *_where(stack_of(call.stack_id), ind + INDENT)]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _explain_inplace(trace: Trace, failing: GradNode, calls: dict[str, Call], message: str) -> str | None:
    """Name the call that saved the tensor and the call that changed it in place."""
    m = _INPLACE.search(message)
    if m is None:
        return None
    out_index, node_class = int(m.group(1)), m.group(2)
    saver = calls.get(failing.call or "")
    if saver is None:
        return None
    # The saved tensor is an input or an output of the failing node's call whose producing call
    # made a node of the class PyTorch names.
    candidates = [*saver.inputs, *saver.outputs]
    saved = None
    for name in candidates:
        rec = trace.tensors.get(name)
        producer = calls.get(rec.producer or "") if rec else None
        if producer is None:
            continue
        # PyTorch names the node "SigmoidBackward0" or, in newer versions, just "Sigmoid".
        kinds = {n.split("/", 1)[1].split("#")[0] for n in producer.grad_nodes} if producer else set()
        if any(k == node_class or k.startswith(node_class + "Backward") for k in kinds):
            outs = [o for o in producer.outputs if trace.tensors.get(o) and trace.tensors[o].producer == producer.name]
            if name in outs and (len(outs) == 1 or outs.index(name) == out_index):
                saved = name
                break
    if saved is None:
        return (f"The tensor {saver.name} saved for backward (output {out_index} of {node_class}) was changed "
                f"in place after {saver.name} used it.")
    changer = next((t for t in trace.tensors.values() if t.previous == saved), None)
    by = f"{changer.producer} (making {changer.name})" if changer and changer.producer else "an untraced change"
    return (f"{saved}, saved for backward by {saver.name} ({saver.api}), was modified in place by {by} "
            f"before backward ran.")
