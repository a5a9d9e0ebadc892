"""The canonical compact text form of a trace: one line per call, one per backward step.

    linear3  F.linear  h.0.mlp.c_proj  (clamp0:out, h.0.mlp.c_proj.weight, h.0.mlp.c_proj.bias) -> linear3:out f32[4,32,64] 1a2b3c4d
    backward0  Tensor.backward  (cross_entropy0:out)
    backward0  linear3/AddmmBackward0  <- linear3/ViewBackward0#1:grad0 -> h.0.mlp.c_proj.bias@grad f32[64] 5e6f7a8b, ...

Forward lines come in execution order, indented two spaces per module depth (``h.0.mlp.c_proj``
is depth 4) and two more per enclosing custom ``autograd.Function`` call. The fields are the
call name, its API (``torch.nn.functional.`` shortened to ``F.``), its module path (``-`` for
code outside any module or in the root module), the input tensors by name and the output
tensors as ``name dtype[shape] md5-prefix``. A tensor without a hash shows ``-``.

After the forward lines, each backward run has a line (name, API, root tensors), then one line
per grad node in the order the engine ran them: the gradients it received (``<-``, by name) and
the ones it produced (``->``, described like forward outputs).

The text depends only on what the program computed: no times, hosts, absolute paths or ids, so
two recordings of the same program give the same text, and tests compare it with inline
expected strings. Calls that raised end in ``!! error``; a trace that did not finish ends with a
``status`` line.
"""

from __future__ import annotations

from tracer.model import Call, TensorRecord, Trace

HASH_CHARS = 8

_DTYPE_SHORT = {
    "float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "complex64": "c64", "complex128": "c128", "complex32": "c32", "bool": "bool",
}
_API_PREFIXES = (("torch.nn.functional.", "F."),)


def short_dtype(dtype: str) -> str:
    return _DTYPE_SHORT.get(dtype, dtype)


def short_api(api: str) -> str:
    for long, short in _API_PREFIXES:
        if api.startswith(long):
            return short + api[len(long):]
    return api


def shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def describe_tensor(trace: Trace, name: str | None, *, hashes: bool = True) -> str:
    """``name f32[2,3,8] 1a2b3c4d`` (the hash part only when ``hashes``)."""
    if name is None:
        return "-"
    rec = trace.tensors.get(name)
    if rec is None:  # a name the trace lost (a truncated file): keep the name alone
        return name
    text = f"{name} {short_dtype(rec.dtype)}{shape_text(rec.shape)}"
    if hashes:
        text += " " + short_hash(rec)
    return text


def short_hash(rec: TensorRecord) -> str:
    return rec.md5[:HASH_CHARS] if rec.md5 else "-"


def module_depth(module: str) -> int:
    return 0 if not module else module.count(".") + 1


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
            f"({', '.join(call.inputs)}) -> {outs}")
    if call.phase == "backward" and (call.parent is None or call.parent not in calls):
        # Made by a grad node's own code; a call nested in another call shows by its indent.
        line += f"  [in backward of {call.parent}]" if call.parent else "  [in backward]"
    if call.error:
        line += f"  !! {call.error}"
    return line


def _names(names: list[str | None]) -> str:
    return ", ".join("-" if n is None else n for n in names) or "-"


def to_text(trace: Trace, *, hashes: bool = True, backward: bool = True) -> str:
    """The whole trace as canonical text (ends with a newline unless the trace is empty)."""
    calls = {c.name: c for c in trace.calls}
    lines = [call_line(trace, c, calls, hashes=hashes) for c in sorted(trace.calls, key=lambda c: c.seq)]
    if backward:
        for run in sorted(trace.backward_runs, key=lambda b: b.seq):
            head = f"{run.name}  {run.api}  ({', '.join(run.roots)})"
            if run.outputs:
                head += " -> " + ", ".join(describe_tensor(trace, o, hashes=hashes) for o in run.outputs)
            if run.status != "ok":
                head += f"  !! {run.status}: {run.error or ''}".rstrip()
            lines.append(head)
            for step in run.steps:
                outs = ", ".join(describe_tensor(trace, g, hashes=hashes) for g in step.grads_out) or "-"
                lines.append(f"{run.name}  {step.node}  <- {_names(step.grads_in)} -> {outs}")
    if trace.status != "ok":
        err = trace.error or {}
        detail = f": {err.get('type', '')}: {err.get('message', '')}" if err else ""
        lines.append(f"status {trace.status}{detail}")
    return "".join(line + "\n" for line in lines)
