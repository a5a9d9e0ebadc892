"""Planned readings: one list of tensors read again and again through ``Fused.plan`` (the step
log's parameters and gradients at every optimizer step) gives the fingerprints and norms the
general path (``Fused.add`` per tensor) and the plain-Python reference give, while the list
changes the ways a training loop changes it; a plan is made once and followed while it can be.

Without a GPU the kernels run under Triton's CPU interpreter in a subprocess
(tests/fused_plan_interpreted.py); tests/test_steplog_cuda.py runs a plan on a GPU.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.interpreted import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

# case -> (plans made so far, plans that followed moved tensors so far)
COUNTS = {
    "first": (1, 0),
    "again": (1, 0),  # the same tensors where they were: the plan as it is
    "changed in place": (1, 0),  # new values, same addresses: the plan reads the new values
    "moved": (1, 1),  # two tensors elsewhere: the same plan, their addresses updated
    "parted": (2, 1),  # two entries that shared their bytes no longer do: a new plan
    "a new dtype": (3, 1),
    "a None less": (4, 1),
    "transposed": (4, 1),  # not contiguous: no plan, the general path
    "two bytes in": (4, 1),  # not on a word: no plan, the general path
    "after the general path": (5, 1),
    "misaligned words": (6, 1),  # on a word, not on 16 bytes: a plan of the kernel's other variant
}


@pytest.fixture(scope="module")
def planned() -> dict:
    return run_interpreted("tests.fused_plan_interpreted")


def test_a_planned_reading_equals_the_general_path_and_the_reference(planned):
    assert list(planned) == list(COUNTS)
    for name, case in planned.items():
        assert case["planned"] == case["general"] == case["reference"], name
        # the norms: the same kernel sums on both paths, so the same floats; the float64
        # reference's within float32's precision (the kernel sums 32-bit floats in float32)
        assert case["norms"] == case["general_norms"], name
        norms = [None if n == "None" else float(n) for n in case["norms"]]
        assert norms == pytest.approx(case["reference_norms"], rel=1e-6, nan_ok=True), name


def test_a_plan_is_made_once_and_followed_while_its_tensors_stay_or_only_move(planned):
    assert {name: (case["plans"], case["moves"]) for name, case in planned.items()} == COUNTS
    first = planned["first"]["planned"]
    assert first[0] == first[4] and first[1] is None  # one row for the same tensor twice; None stays None
    assert planned["changed in place"]["planned"][0] != first[0]
