"""Free-text strings of a trace clipped for display: the pages and the terminal views.

A real trace's source lines, module paths and args strings are a few hundred characters at
most; a hostile or odd one may hold megabytes in one string. Every view that prints such a
string (the HTML report, ``gradtrace show`` and ``summary``) takes the trace through
``clipped`` first: each string longer than ``LONG_TEXT_LIMIT`` keeps its first characters and
says how long it was. Record names stay whole: views link and look records up by them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tracer.model import Trace
from tracer.model.display import LONG_TEXT_LIMIT, clip_long


def clipped(trace: Trace, limit: int = LONG_TEXT_LIMIT) -> Trace:
    """``trace`` with each free-text string longer than ``limit`` characters clipped
    (``clip_long``: the first ``limit`` characters and the full length); ``trace`` itself when
    none is. Record names stay whole: they are what the page links by."""
    def long(*texts: str | None) -> bool:
        return any(t is not None and len(t) > limit for t in texts)

    def cut(text: str | None) -> str | None:
        return None if text is None else clip_long(text, limit)

    def cut_json(v: Any) -> Any:
        if isinstance(v, str):
            return clip_long(v, limit)
        if isinstance(v, dict):
            return {clip_long(str(k), limit): cut_json(x) for k, x in v.items()}
        if isinstance(v, list):
            return [cut_json(x) for x in v]
        return v

    calls = [replace(c, api=clip_long(c.api, limit), module=clip_long(c.module, limit), args=clip_long(c.args, limit),
                     error=cut(c.error)) if long(c.api, c.module, c.args, c.error) else c for c in trace.calls]
    frames = [replace(f, file=clip_long(f.file, limit), function=clip_long(f.function, limit),
                      code=clip_long(f.code, limit)) if long(f.file, f.function, f.code) else f for f in trace.frames]
    nodes = [replace(n, kind=clip_long(n.kind, limit)) if long(n.kind) else n for n in trace.grad_nodes]
    runs = [replace(r, api=clip_long(r.api, limit), error=cut(r.error)) if long(r.api, r.error) else r
            for r in trace.backward_runs]
    tensors = {k: replace(t, dtype=clip_long(t.dtype, limit), device=clip_long(t.device, limit),
                          hash_note=cut(t.hash_note)) if long(t.dtype, t.device, t.hash_note) else t
               for k, t in trace.tensors.items()}
    changed = (any(a is not b for a, b in zip(calls, trace.calls)) or any(a is not b for a, b in zip(frames, trace.frames))
               or any(a is not b for a, b in zip(nodes, trace.grad_nodes))
               or any(a is not b for a, b in zip(runs, trace.backward_runs))
               or any(tensors[k] is not t for k, t in trace.tensors.items())
               or long(*trace.modules, *trace.modules.values(), *trace.notes, *(trace.error or {}).values())
               or cut_json(trace.header) != trace.header or cut_json(trace.meta) != trace.meta)
    if not changed:
        return trace
    out = Trace(header=cut_json(trace.header), meta=cut_json(trace.meta), calls=calls, grad_nodes=nodes,
                tensors=tensors, backward_runs=runs,
                modules={clip_long(p, limit): clip_long(c, limit) for p, c in trace.modules.items()},
                frames=frames, stacks=trace.stacks, status=trace.status,
                error=None if trace.error is None else {k: clip_long(v, limit) for k, v in trace.error.items()},
                notes=[clip_long(n, limit) for n in trace.notes], memory=trace.memory)
    out.resolve()
    return out
