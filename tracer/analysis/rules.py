"""The named rules of the numerics analysis: which Infs are intended, and which non-finite values
no later value keeps (dropped). One place, so that the analysis, the ``raise_on_nonfinite``
guard and the docs agree, and so that a rule is added on purpose, not grown inline.

**Adding a rule.** A rule exists because a real model made a report say something false. Add one
only with that case: give it a ``name``, say what it matches in one sentence (``matches``), name
the model or recipe that admitted it (``admitted_by``) and the test that fails without it
(``test``: ``tests/test_rules.py::test_<name>``, the rule's smallest case), then make the
analysis consult it by name.
``tests/test_rules.py`` checks that every rule has its test there and that docs/api.md lists
every rule. A rule never hides a NaN made from finite values: it may only call an Inf intended or a
value dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One named rule: what it matches, the case that admitted it, and the test that pins it."""

    name: str
    matches: str
    admitted_by: str
    test: str


# ---- intended Infs: a call whose outputs hold Infs is not where an anomaly was made when -----------
INF_CONSTANT = Rule(
    "inf-constant",
    "the call's non-tensor arguments hold an infinite constant (masked_fill(mask, -inf), "
    "where(m, x, -inf), full(shape, -inf))",
    "HF GPT-2's causal attention mask and every hand-written -inf mask",
    "tests/test_rules.py::test_inf_constant")
CARRIES_INTENDED = Rule(
    "carries-intended-inf",
    "every input holding an Inf holds an intended one, no output holds more Infs than its inputs "
    "bring (counted per element of broadcasting), and no one-element output is reduced from a "
    "larger input",
    "a mask broadcast over the heads and added to the scores; a loss of +inf from a target whose "
    "logit was masked is NOT carried (a reduction kept it)",
    "tests/test_rules.py::test_carries_intended_inf")
INTENDED_INF_RULES = (INF_CONSTANT, CARRIES_INTENDED)

# ---- dropped values: a NaN/Inf value is not reported when every call that reads it -----------------
INTEGER_OUTPUT = Rule(
    "integer-output",
    "makes only integer or boolean values from it (a cast, a comparison)",
    "HF T5's relative position buckets: log(0) = -inf cast to integers, at every step",
    "tests/test_rules.py::test_integer_output")
SELECTION = Rule(
    "selection",
    "makes a finite value by selecting elements (where, nan_to_num, masked_fill)",
    "the idiom where(x > 0, log(x), 0)",
    "tests/test_rules.py::test_selection")
SOFTMAX_OF_MASK = Rule(
    "softmax-of-mask",
    "is a softmax whose output is finite: it reads -inf as a masked position",
    "HF GPT-Neo: two finfo.min masks added overflow to -inf exactly where softmax masks anyway",
    "tests/test_rules.py::test_softmax_of_mask")
DROPPED_IN_TURN = Rule(
    "dropped-in-turn",
    "makes values that are dropped in turn (at most 64 calls deep)",
    "T5: the integer bucket is itself selected away by where",
    "tests/test_rules.py::test_dropped_in_turn")
SELECTION_IN_BACKWARD = Rule(
    "selection-in-backward",
    "is a grad node that makes only finite gradients from it (a product with an Inf is Inf or "
    "NaN, never finite: the node selected it away), not an accumulator (it keeps it in .grad)",
    "sqrt(relu(x)): SqrtBackward0 makes +Inf where relu gave 0, ReluBackward0 zeroes it there",
    "tests/test_rules.py::test_selection_in_backward")
DROPPING_RULES = (INTEGER_OUTPUT, SELECTION, SOFTMAX_OF_MASK, DROPPED_IN_TURN, SELECTION_IN_BACKWARD)

RULES = (*INTENDED_INF_RULES, *DROPPING_RULES)

# The APIs the selection and softmax rules name.
SELECTING_APIS = frozenset({"torch.where", "Tensor.where", "torch.nan_to_num", "Tensor.nan_to_num",
                            "Tensor.nan_to_num_", "torch.masked_fill", "Tensor.masked_fill", "Tensor.masked_fill_"})
SOFTMAX_APIS = frozenset({"torch.softmax", "Tensor.softmax", "torch.nn.functional.softmax", "torch.special.softmax"})
FLOATING_DTYPES = ("float", "bfloat", "complex")  # dtype name prefixes that can hold NaN/Inf
MAX_DROP_DEPTH = 64  # calls a dropped value may pass through first (deeper chains are reported)

# An inf among a call's argument text: "-inf", "inf", "fill_value=-inf", "[0.0, inf]".
_INF_CONSTANT = re.compile(r"(?<![\w.])-?inf(?![\w])")


def has_inf_constant(args: str) -> bool:
    """Rule ``inf-constant``: whether a call's argument text holds an infinite constant."""
    return "inf" in args and _INF_CONSTANT.search(args) is not None


def carries_intended_inf(outs: list[tuple[int, int]], ins: list[tuple[int, int, bool]]) -> bool:
    """Rule ``carries-intended-inf``, for a call whose outputs hold Infs.

    ``outs``: (Inf count, elements) of each output holding an Inf; ``ins``: (Inf count, elements,
    intended) of each input holding one. Shared by the analysis and the ``raise_on_nonfinite``
    guard, so both call the same Infs intended."""
    if not ins or not all(intended for _, _, intended in ins):
        return False
    for inf, numel in outs:
        if numel == 1 and any(n > 1 for _, n, _ in ins):
            return False
        if inf > sum(count * max(1, numel // max(n, 1)) for count, n, _ in ins):
            return False
    return True


def keeps_finite_by_selection(api: str) -> bool:
    """Rules ``selection`` and ``softmax-of-mask``: a finite output of ``api`` leaves the NaN/Inf
    it read behind."""
    return api in SELECTING_APIS or api in SOFTMAX_APIS


__all__ = ["CARRIES_INTENDED", "DROPPED_IN_TURN", "DROPPING_RULES", "FLOATING_DTYPES", "INF_CONSTANT",
           "INTEGER_OUTPUT", "INTENDED_INF_RULES", "MAX_DROP_DEPTH", "RULES", "SELECTION", "SELECTION_IN_BACKWARD",
           "SOFTMAX_OF_MASK", "Rule",
           "carries_intended_inf", "has_inf_constant", "keeps_finite_by_selection"]
