"""The unified naming system: API names, call names, tensor names, grad node names.

Names are deterministic (counters start fresh in every trace, so the same program gives the
same names twice), readable, and linked:

- call ``linear3``: the fourth ``linear`` call of the trace (counters count from 0; a short
  name ending in a digit gets an underscore, ``log10_0``, so names never run together);
- its output tensor ``linear3:out`` (``split2:out0``, ``split2:out1`` when it has several);
- a tensor changed in place gets a new version ``linear3:out@v1`` (``...weight@v1``);
- parameters and buffers by module path ``transformer.h.0.attn.c_attn.weight``; other tensors
  from outside the block ``input0``, ``input1``...;
- its grad node ``linear3/AddmmBackward0``, showing the API call and PyTorch's class
  (``linear3/ViewBackward0#1`` when one call creates two nodes of a class); a leaf accumulator
  ``<param>/AccumulateGrad``;
- a gradient ``linear3:out@grad`` (the gradient of that tensor), ``<param>@grad``; a gradient
  that a node sends along one of several incoming edges ``<node>:grad<j>``; in the k-th backward
  run of a trace (k >= 1) gradient names end in ``#k``;
- a non-leaf tensor's retained ``.grad`` (``retain_grad``) ``linear3:out.grad``: the copy the
  engine stores, a record of its own; ``linear3:out.grad@v1`` for its next value.
"""

from __future__ import annotations

import re


def output_name(call: str, index: int, count: int) -> str:
    return f"{call}:out" if count == 1 else f"{call}:out{index}"


def base_name(name: str) -> str:
    """A tensor value's name without its version: ``x`` for ``x@v3``; ``x:out@v1@grad`` (the
    gradient of a version) keeps its ``@v1``: only a trailing version is one."""
    head, sep, tail = name.rpartition("@v")
    return head if sep and tail.isdigit() else name


def version_name(base: str, version: int) -> str:
    """``x`` changed in place for the n-th time in this trace -> ``x@v<n>``."""
    return f"{base_name(base)}@v{version}"


def grad_suffix(run_index: int) -> str:
    return "@grad" if run_index == 0 else f"@grad#{run_index}"


# <tensor>@grad, <tensor>@grad#<k> (k-th backward run), either with @v<n> (accumulated into);
# version-1 files spelled a leaf's .grad <tensor>.grad.
_GRADIENT = re.compile(r"^(?P<of>.+?)(?:@grad|\.grad)(?:#\d+)?(?:@v\d+)?$")


def gradient_of(name: str) -> str | None:
    """The tensor a gradient's name belongs to (``w`` for ``w@grad``, ``w@grad#1``, ``w@grad@v2``),
    or None when ``name`` is not a gradient's name."""
    m = _GRADIENT.match(name)
    return m.group("of") if m else None


# ---- qualified names ----------------------------------------------------------------------------
# Names are unique within a kind, not across kinds: a parameter a module holds as ``linear0`` is
# the tensor ``linear0`` beside the call ``linear0``; a buffer ``backward0`` beside the backward
# run. ``<kind>:<name>`` always names one record (no name of any kind starts with these words and
# a colon: calls and runs end in a counter, and a tensor's colon follows its call's name).
KINDS: dict[str, str] = {"call": "call", "tensor": "tensor", "node": "grad node", "backward": "backward run"}


def split_qualified(name: str) -> tuple[str | None, str]:
    """``("tensor", "linear0")`` for ``tensor:linear0``; ``(None, name)`` for a bare name."""
    kind, sep, rest = name.partition(":")
    if sep and kind in KINDS and rest:
        return kind, rest
    return None, name


def qualified(kind: str, name: str) -> str:
    """The spelling of ``name`` that names the record of ``kind`` alone: ``call:linear0``."""
    return f"{kind}:{name}"
