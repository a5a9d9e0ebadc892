"""Planned readings (``Fused.plan``, ``Fused.follow``, ``Fused.launch``, through the step log's
``Digester.read(plan=...)``) on the CPU under Triton's interpreter.

Run by tests/test_fused_plan.py in a subprocess (``TRITON_INTERPRET=1`` must be set before
triton is first imported). One list of tensors is read again and again through one plan while
it changes the ways a training loop changes it; every reading is read the general way too (no
plan: ``Fused.add`` per tensor) and by the plain-Python reference. Prints one JSON object:
per case, the three readings' fingerprints, both paths' norms and the reference norms, and how
many plans were made and how many times a plan followed moved tensors so far.
"""

from __future__ import annotations

import json
import sys

import torch

from tracer.features.steplog.digests import Digester
from tracer.record.checksums import fused
from tracer.record.checksums.fingerprint import fingerprint_reference

COUNTS = {"plans": 0, "moves": 0}


def _counted() -> None:
    plan, move = fused.Fused.plan, fused.Fused._move

    def counted_plan(self: fused.Fused, tensors: list[torch.Tensor]) -> fused.Plan | None:
        made = plan(self, tensors)
        COUNTS["plans"] += made is not None
        return made

    def counted_move(self: fused.Fused, p: fused.Plan, ptrs: list[int]) -> bool:
        moved = move(self, p, ptrs)
        COUNTS["moves"] += moved
        return moved

    fused.Fused.plan = counted_plan  # type: ignore[method-assign]
    fused.Fused._move = counted_move  # type: ignore[method-assign]


def _reference(t: torch.Tensor | None) -> tuple[str | None, float | None]:
    if t is None:
        return None, None
    data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return fingerprint_reference(data), float(torch.linalg.vector_norm(t.detach().to(torch.float64)))


def main() -> None:
    _counted()
    planned, general = Digester(interpret=True), Digester(interpret=True)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 70, generator=g)
    b = torch.randn(9, dtype=torch.float64, generator=g)
    c = torch.randn(33, generator=g).bfloat16()
    e = torch.arange(-3, 4)
    big = torch.randn(200_000, generator=g)  # 800 kB: three programs
    nan = torch.tensor([1.0, float("nan"), float("inf")])
    out: dict[str, object] = {}

    def case(name: str, tensors: list[torch.Tensor | None]) -> None:
        fps, norms = planned.read(tensors, plan="p").result()
        gen_fps, gen_norms = general.read(tensors).result()
        ref = [_reference(t) for t in tensors]
        out[name] = {"planned": fps, "general": gen_fps, "reference": [r[0] for r in ref],
                     "norms": [repr(n) for n in norms], "general_norms": [repr(n) for n in gen_norms],
                     "reference_norms": [r[1] for r in ref], **COUNTS}

    case("first", [a, None, b, c, a, e, big, nan])  # a twice: one row serves both
    case("again", [a, None, b, c, a, e, big, nan])
    a.mul_(-2)  # new values at the same addresses
    case("changed in place", [a, None, b, c, a, e, big, nan])
    b2, big2 = b.clone(), big.clone() + 1  # gradients the allocator placed elsewhere
    case("moved", [a, None, b2, c, a, e, big2, nan])
    case("parted", [a, None, b2, c, a.clone(), e, big2, nan])  # the two a's no longer share bytes
    case("a new dtype", [a, None, b2, c.float(), a, e, big2, nan])
    case("a None less", [a, b, b2, c, a, e, big2, nan])
    case("transposed", [a.t(), None, b2, c, a, e, big2, nan])  # not contiguous: no plan, the general path
    case("two bytes in", [a, None, b2, c.view(-1)[1:], a, e, big2, nan])  # not on a word: no plan
    case("after the general path", [a, None, b2, c, a, e, big2, nan])
    case("misaligned words", [a.view(-1)[1:], None, b2, c, a, e, big2, nan])  # on a word, not on 16 bytes
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
