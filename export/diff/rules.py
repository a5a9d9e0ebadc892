"""How ``diff`` classifies a record, and the lists it matches against: the rules in one place.

Every aligned record (a call, or a grad node's step in a backward run) whose outputs differ, and
every record only one trace has, is classified by ``classify``: the engine gathers what it knows
of the record as ``Facts`` (which inputs differ and why, the API, the arguments, where a call
inside a backward ran) and the first rule of ``ROW_RULES`` that matches gives the row its
``status``, its ``note`` and its ``Row.rule`` (the rule's name, also the ``rule`` key of the
JSON). Nothing downstream reads a note's words to decide anything: it reads ``Row.rule``.

Random ops are the APIs of ``RANDOM_OPS``: a call of one whose inputs match but whose outputs
differ drew different random numbers, so the RNG state (a seed, a generator, the number of
draws before it) differs, not the program.

Adding a rule (or a random op):

1. a name, short and stable (``Row.rule`` and the JSON carry it: never rename one);
2. ``matches``: in words, which records it takes;
3. ``admitted_by``: the case where ``diff`` told a wrong or vague story without it (a program,
   a model, an issue), so that the next reader knows why it exists;
4. ``test``: ``tests/<file>.py::<test>``, a test that records that case (two real runs) and
   asserts the row's ``rule`` and note; ``tests/test_diff_story.py`` checks that every rule and
   every random-op group names a test that exists.

A rule goes before the rules it refines (the first match wins); a new API goes into the group of
``RANDOM_OPS`` it belongs to, or a new group with its own case and test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tracer.analysis.rules import Rule as NamedRule
from tracer.model.display import format_number

# ---- facts of one record ------------------------------------------------------------------------
# Why one differing input differs: a value from before the block (a parameter, a buffer, an
# input: where a difference enters), an earlier call's output that differs, a value made by a
# call only one trace has, or a gradient (backward made it).
SOURCE, FORWARD, STRUCTURE, BACKWARD = "source", "forward", "structure", "backward"


@dataclass(frozen=True)
class Facts:
    """What the engine knows of one record when it classifies it.

    ``record``: ``call`` (a call of any phase but backward, or a call a grad node's hooks or own
    code made), ``node`` (a grad node's step) or ``only`` (a record only one trace has: ``only_in``
    says which). ``inputs`` holds, per differing input, why it differs (``SOURCE`` ...).
    ``inside``: for a call a backward made, the grad node it ran in, and ``hook`` whether it ran
    in a hook of that node rather than the node's own code. ``node_call``: the forward call
    that made the node (or the node a call ran in), ``call_touched`` what of it differed in the
    forward (``""``: it matched).
    """

    record: str
    name: str = ""
    api: str = ""
    inputs: frozenset[str] = frozenset()
    tolerance: bool = False
    rel: float | None = None
    mismatch: str = ""          # the first differing output's shape or dtype mismatch, in words
    args: str = ""              # "'3' vs '5'" when the call's arguments differ
    sources: tuple[str, ...] = ()        # "param 0.weight": the changed values read
    read_first_by: tuple[str, ...] = ()  # earlier readers of those, whose outputs matched
    structure: str = ""         # "reads x, made by a call only one trace has"
    inside: str = ""
    hook: bool = False
    node_call: str | None = None
    call_touched: str = ""
    only_in: str = ""
    cast: bool = False
    # Inputs that could not be compared, in words (``weight@grad (not hashed: sparse_coo layout)``):
    # a difference may have come in through them.
    unknown: tuple[str, ...] = ()
    # Gradients a node makes on one side only, in words (``B makes no gradient for 0.bias``): a
    # parameter frozen in one run. A change of structure, which no nondeterminism explains.
    missing: str = ""
    # ``node_call`` did not align with a call of B (``cross_entropy0 is only in A's forward, B's
    # cross_entropy0 only in B's``: another batch size): nothing says its forward matched.
    call_unaligned: str = ""
    # A random op only one trace called before this one (``kaiming_uniform_1, only in B``): it
    # drew from the RNG first, so this op's draws differ for a known reason.
    rng_advanced_by: str = ""

    @property
    def inputs_match(self) -> bool:
        return not self.inputs


@dataclass(frozen=True)
class Rule(NamedRule):
    """One way a record is classified (see the module docstring): a named rule, as the numerics
    analysis keeps them, with the status it gives and how it decides and explains."""

    status: str
    applies: Callable[[Facts], bool]
    note: Callable[[Facts], str]


# ---- random ops ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RandomOps:
    """A group of APIs that draw random numbers, by the last part of their name (``dropout`` is
    ``torch.nn.functional.dropout``, ``torch.dropout``, ``Tensor.dropout``...)."""

    name: str
    apis: frozenset[str]
    admitted_by: str
    test: str


RANDOM_OPS: tuple[RandomOps, ...] = (
    RandomOps("dropout", frozenset({"dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                                    "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_",
                                    "feature_dropout", "feature_dropout_", "native_dropout"}),
              "issue 42: nn.Dropout in training mode with another seed diverged at dropout0, reported as "
              "'inputs match, outputs differ' with no word on the RNG",
              "tests/test_diff_story.py::test_a_random_op_with_equal_inputs_says_the_rng_state_differs"),
    RandomOps("sampling", frozenset({"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
                                     "multinomial", "bernoulli", "bernoulli_", "normal", "normal_", "uniform_",
                                     "random_", "exponential_", "geometric_", "log_normal_", "cauchy_", "poisson",
                                     "rrelu", "rrelu_", "gumbel_softmax"}),
              "issue 42: noise drawn with torch.randn from another generator seed (a custom Function's "
              "forward and backward, tests/test_diff.py) was 'inputs match, outputs differ'",
              "tests/test_diff_story.py::test_a_random_op_with_equal_inputs_says_the_rng_state_differs"),
    RandomOps("init", frozenset({"kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                                 "trunc_normal_", "orthogonal_", "sparse_"}),
              "issue 42: a model built inside the traced step (gradtrace run --steps 0) with another seed "
              "diverged at its first nn.init call",
              "tests/test_diff_story.py::test_a_model_built_with_another_seed_differs_at_its_first_init"),
)
# Where the random APIs live: a user's own function that happens to be called "dropout" is not one.
_RANDOM_PREFIXES = ("torch.", "Tensor.")
_RANDOM_NAMES = frozenset().union(*(g.apis for g in RANDOM_OPS))


def random_op(api: str) -> str | None:
    """The group of ``RANDOM_OPS`` that ``api`` belongs to, or None."""
    if not api.startswith(_RANDOM_PREFIXES):
        return None
    last = api.rpartition(".")[2]
    if last not in _RANDOM_NAMES:
        return None
    return next(g.name for g in RANDOM_OPS if last in g.apis)


# Work that only changes a dtype. Comparing across precisions (fp32 vs bf16 autocast) adds or
# drops such steps (autocast's casts show up as ToCopyBackward0 nodes); with a tolerance they are
# expected and listed apart instead of counting as a change of structure.
CAST_APIS = frozenset({"Tensor.to", "Tensor.float", "Tensor.half", "Tensor.bfloat16", "Tensor.double",
                       "Tensor.type", "Tensor.type_as"})
CAST_NODES = frozenset({"ToCopyBackward0"})


# ---- the words ------------------------------------------------------------------------------------
def _beyond(f: Facts) -> str:
    """``rel 0.5``: how far outputs went beyond a tolerance; where nothing was measured beyond it,
    the mismatch that was (a shape mismatch has no number: ``shape [3] vs [5]``)."""
    return f.mismatch if f.mismatch and not f.rel else f"rel {format_number(f.rel, 3)}"


def outputs_differ(f: Facts, what: str = "inputs") -> str:
    """``inputs match, outputs differ`` in the words of the comparison mode."""
    if f.tolerance:
        return f"{what} within tolerance, outputs beyond it ({_beyond(f)})"
    return f"{what} match, outputs differ" + (f" ({f.mismatch})" if f.mismatch else "")


def _where(f: Facts) -> str:
    """``randn0 in the backward of Noisy0/NoisyBackward: `` for a call a backward made."""
    if not f.inside:
        return ""
    return f"{f.name} in {'a backward hook of' if f.hook else 'the backward of'} {f.inside}: "


def _matched(f: Facts) -> str:
    return "stayed within tolerance" if f.tolerance else "matched"


def _is_random(f: Facts) -> bool:
    # (arguments that differ, a dropout's p, are the story: a known difference, not a guess at the RNG)
    return f.record == "call" and f.inputs_match and not f.args and random_op(f.api) is not None


def _backward_only(f: Facts) -> bool:
    """A backward's own record whose gradients in match, of a node whose forward call matched:
    the backward itself computed something else. (A forward call that did not align did not
    match, and a gradient one side does not make is a change of structure: neither is this.)"""
    if f.call_unaligned or f.missing:
        return False
    if f.record == "call":
        return bool(f.inside) and not f.hook and f.inputs_match and f.node_call is not None and not f.call_touched
    return f.record == "node" and f.inputs <= {SOURCE} and f.node_call is not None and not f.call_touched


def _random_note(f: Facts) -> str:
    text = _where(f) + "random op with equal inputs: the RNG state differs"
    if f.rng_advanced_by:  # (a known cause: the other trace's extra random op drew first)
        text += f", advanced by {f.rng_advanced_by}, which drew from it before"
    if f.inside and not f.hook and f.node_call is not None and not f.call_touched and not f.call_unaligned:
        return f"backward-only: {text} ({f.node_call} {_matched(f)} in forward)"
    return text


def _backward_only_note(f: Facts) -> str:
    if f.record == "call" and f.args:  # (a known difference, the arguments: no guess at nondeterminism)
        return f"backward-only: {_arguments_note(f)} while {f.node_call} {_matched(f)} in forward"
    text = _where(f) + outputs_differ(f) if f.record == "call" else outputs_differ(f, "gradients in")
    seed = "; the seed gradient differs" if SOURCE in f.inputs else ""
    return f"backward-only: {text} while {f.node_call} {_matched(f)} in forward (nondeterministic backward?){seed}"


def _missing_note(f: Facts) -> str:
    text = _where(f) + ("inputs match" if f.record == "call" else "gradients in match") + f", but {f.missing}"
    return text + ("; the seed gradient differs" if SOURCE in f.inputs else "")


def _unaligned_note(f: Facts) -> str:
    text = _where(f) + outputs_differ(f) if f.record == "call" else outputs_differ(f, "gradients in")
    return f"{text}; its forward call did not align: {f.call_unaligned}" + \
        ("; the seed gradient differs" if SOURCE in f.inputs else "")


def _arguments_note(f: Facts) -> str:
    if f.tolerance:
        return _where(f) + f"inputs within tolerance, arguments differ ({f.args}), outputs beyond it " \
                           f"({_beyond(f)})"
    return _where(f) + f"inputs match, arguments differ ({f.args}), outputs differ" + \
        (f" ({f.mismatch})" if f.mismatch else "")


def _source_note(f: Facts) -> str:
    leaves = ", ".join(f.sources)
    if not f.read_first_by:
        return f"first call to read the changed {leaves}: input differs, outputs differ"
    # an earlier reader's outputs came out equal (the change was rounded away)
    return (f"reads the changed {leaves} (read first by {', '.join(f.read_first_by)}, whose outputs matched): "
            "input differs, outputs differ")


def _node_note(f: Facts) -> str:
    if f.node_call is not None and f.call_touched:
        text = f"forward values saved by {f.node_call} differ ({f.call_touched})"
    else:
        text = outputs_differ(f, "gradients in")
    return text + ("; the seed gradient differs" if SOURCE in f.inputs else "")


def _no_note(f: Facts) -> str:
    return ""


# ---- the registry ----------------------------------------------------------------------------------
ROW_RULES: tuple[Rule, ...] = (
    # records only one trace has
    Rule("cast", "a dtype conversion (CAST_APIS, CAST_NODES) only one trace made, compared with a tolerance",
         "fp32 against bf16 autocast: autocast's casts were listed as inserted work",
         "tests/test_diff.py::test_fp32_vs_bf16_autocast_within_tolerance", "cast",
         lambda f: f.record == "only" and f.cast and f.tolerance, _no_note),
    Rule("inserted", "a record only trace B has", "an extra op in the model (h.view, h * 0.5)",
         "tests/test_diff.py::test_inserted_op_is_an_insertion_and_the_rest_aligns", "inserted",
         lambda f: f.record == "only" and f.only_in == "B", _no_note),
    Rule("removed", "a record only trace A has", "an op dropped from the model",
         "tests/test_diff_story.py::test_inserted_and_removed_calls_show_their_line", "removed",
         lambda f: f.record == "only" and f.only_in == "A", _no_note),
    # where a difference enters: inputs match (or only values from before the block differ)
    Rule("unknown-input", "a call whose outputs differ while no input differs, but an input could not be "
         "compared (not hashed: a sparse gradient)",
         "Embedding(sparse=True) under SparseAdam: the sparse gradient is not hashed, and the step that read "
         "it was called an independent origin, 'inputs match, outputs differ'",
         "tests/test_diff_story.py::test_a_call_reading_an_unhashed_value_is_not_called_an_origin", "unknown",
         lambda f: f.record == "call" and f.inputs_match and bool(f.unknown),
         lambda f: _where(f) + f"outputs differ; no compared input differs, but {', '.join(f.unknown)} could not "
                   "be compared: the difference may come from there"),
    Rule("random-op", "a call of a random op (RANDOM_OPS) whose inputs and arguments match and outputs differ",
         "issue 42: dropout or randn with another seed read 'inputs match, outputs differ'",
         "tests/test_diff_story.py::test_a_random_op_with_equal_inputs_says_the_rng_state_differs", "new",
         _is_random, _random_note),
    Rule("missing-gradient", "a record of a backward whose gradients in match (but for the run's seed gradient) "
         "and that makes a gradient on one side only (an input that needs none in the other run)",
         "a bias frozen in B: AddmmBackward0 made no bias gradient in B and was called 'backward-only ... "
         "(nondeterministic backward?)', its difference 'only the checksums differ'",
         "tests/test_diff_structure.py::test_a_frozen_bias_is_a_missing_gradient_not_nondeterminism", "new",
         lambda f: f.record in ("node", "call") and bool(f.missing) and f.inputs <= {SOURCE}, _missing_note),
    Rule("forward-call-unaligned", "a record of a backward whose gradients in match (but for the run's seed "
         "gradient) and outputs differ, of a node whose forward call did not align with one of the other trace",
         "batch size 8 against 16: NllLossBackward0 of cross_entropy0, removed and inserted in forward, was "
         "'backward-only ... while cross_entropy0 matched in forward (nondeterministic backward?)'",
         "tests/test_diff_structure.py::test_another_batch_size_is_no_nondeterministic_backward", "new",
         lambda f: (f.record == "node" or (f.record == "call" and bool(f.inside) and not f.hook))
         and bool(f.call_unaligned) and f.inputs <= {SOURCE}, _unaligned_note),
    Rule("backward-only", "a record of a backward (a call in a custom backward, or a node) whose gradients in "
         "match and whose node's forward call matched, while its outputs differ",
         "a custom Function whose backward scales by a factor its forward never sees: forward matched, "
         "backward went astray (nondeterministic kernels do the same)",
         "tests/test_diff_story.py::test_a_backward_that_computes_otherwise_is_backward_only", "new",
         _backward_only, _backward_only_note),
    Rule("arguments-differ", "a call whose tensor inputs match but whose arguments differ",
         "siamese_network's unseeded random index: x[3] against x[5]",
         "tests/test_diff_truth.py::test_a_numpy_index_is_recorded_by_value_and_named_as_the_difference", "new",
         lambda f: f.record == "call" and f.inputs_match and bool(f.args), _arguments_note),
    Rule("outputs-differ", "a call whose inputs match and outputs differ (in a backward hook: the hook's call)",
         "a backward hook that scales a gradient; fp32 against bf16 autocast compared exactly",
         "tests/test_diff_truth.py::test_a_hook_that_changes_a_gradient_is_the_backward_origin", "new",
         lambda f: f.record == "call" and f.inputs_match, lambda f: _where(f) + outputs_differ(f)),
    Rule("changed-source", "a call whose differing inputs all existed before the block (a parameter, a buffer, "
         "an input): the first call to read the change",
         "one ulp in one weight: the origin is the weight's first reader, not every later call",
         "tests/test_diff.py::test_one_ulp_weight_change_origin_is_first_reader", "new",
         lambda f: f.record == "call" and f.inputs <= {SOURCE}, _source_note),
    Rule("node-outputs-differ", "a grad node whose gradients in match (but for the run's seed gradient) and "
         "outputs differ: its forward call's saved values differ, or no forward call made it",
         "one ulp in one weight: LogSoftmaxBackward0 differs because cross_entropy0's saved input does",
         "tests/test_diff.py::test_one_ulp_weight_change_origin_is_first_reader", "new",
         lambda f: f.record == "node" and f.inputs <= {SOURCE}, _node_note),
    # differences carried on from an origin
    Rule("contaminated", "a record with an input that differs because an earlier record's output does",
         "every record after an origin: counted per module, never a new origin",
         "tests/test_diff.py::test_one_ulp_weight_change_origin_is_first_reader", "contaminated",
         lambda f: FORWARD in f.inputs or (f.record == "node" and BACKWARD in f.inputs), _no_note),
    Rule("after-structure", "a record with an input made by a record only one trace has",
         "an extra op that changes values (h * 0.5): its readers differ because it exists",
         "tests/test_diff.py::test_inserted_op_is_an_insertion_and_the_rest_aligns", "contaminated",
         lambda f: STRUCTURE in f.inputs, lambda f: f.structure if f.record == "call" else ""),
    Rule("gradient", "a call (an optimizer step, clipping) whose inputs differ only because gradients do",
         "a nondeterministic backward: the optimizer step differed, forward did not",
         "tests/test_diff.py::test_nondeterministic_backward_found_in_backward_while_forward_matches", "gradient",
         lambda f: f.record == "call" and f.inputs <= {BACKWARD, SOURCE}, lambda f: "reads gradients that differ"),
)
RULES = {r.name: r for r in ROW_RULES}


def classify(facts: Facts) -> Rule:
    """The first rule of ``ROW_RULES`` that matches ``facts``; a record none matches is
    ``contaminated`` (its inputs differ for a reason no rule names)."""
    for rule in ROW_RULES:
        if rule.applies(facts):
            return rule
    return RULES["contaminated"]


# ---- the runs parted before the traced step --------------------------------------------------------
# What finds the step where two runs parted: a log of every step of both runs and a bisection.
FIND_EARLIER_STEP = "run both with `gradtrace run --log a.gtsteps …` and `gradtrace bisect a.gtsteps b.gtsteps`"


def parted_earlier(n: int) -> str:
    """The verdict's first words when every parameter already differed as the traced step began."""
    return (f"all {n} parameters differed as the step began: the runs parted at an earlier step; "
            f"to find it, {FIND_EARLIER_STEP}")


__all__ = ["BACKWARD", "CAST_APIS", "CAST_NODES", "FIND_EARLIER_STEP", "FORWARD", "RANDOM_OPS", "ROW_RULES", "RULES",
           "SOURCE", "STRUCTURE", "Facts", "RandomOps", "Rule", "classify", "outputs_differ", "parted_earlier",
           "random_op"]
