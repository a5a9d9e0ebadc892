"""The phases of a step and the rules that put a call in one: ``forward``, ``backward``, ``optimizer``.

A training step runs a forward pass, one or more backward runs, and then works on what the
backward left: it clips and unscales the gradients, runs the optimizer, updates an EMA copy,
zeroes the gradients. Those last calls are the ``optimizer`` phase. The recorder decides a call's
phase as it records it (tracer/record/phases.py applies the rules below with what it sees live);
a file of format version 2, which knew two phases, gets them applied on load (``upgrade_phases``).

The rules, in order (the first that applies decides; docs/trace-format.md "Phases" says the same):

1. a call made while a backward run is in progress is ``backward`` (hooks, custom backwards,
   recomputed forwards, an optimizer stepped from a post-accumulate-grad hook);
2. an optimizer step (a call of kind ``optimizer``) is ``optimizer``;
3. a call inside a module's forward is ``forward``, and closes the optimizer window (rule 6);
4. a call that builds a graph (an output requires grad, other than a leaf it wrote in place: a
   parameter updated under ``no_grad``) is ``forward``;
5. a call that reads or writes optimizer state, a gradient of the model's state (not one
   ``torch.autograd.grad`` returns, nor the ``.grad`` of a tensor a call of the block made: an
   input made from the data, as adversarial training does), or a value an ``optimizer`` call made,
   or that writes a parameter or buffer, or reads one while the optimizer window is open (rule 6),
   is ``optimizer`` (clipping, unscaling, EMA, weight clamping, a manual SGD update,
   ``zero_grad(set_to_none=False)``);
6. while the optimizer window is open (from the end of a backward run, or from the start of a
   step trace that began at the optimizer step ending the step before, to the next module
   forward), a call that changes a tensor in place from its old value (an EMA copy's ``mul_``),
   or that torch's own optimizer, AMP or clipping code makes (GradScaler's ``found_inf``), is
   ``optimizer``; one that overwrites a tensor whole (``fill_``, ``zero_``, ``random_``,
   ``copy_``: the next batch's labels, a DataLoader's seed, a batch copied into a kept buffer)
   reads nothing of it and decides nothing here, nor does one that writes only what the step's
   data calls made since the window opened (``x = batch.clone(); x[0, 0] = v``; live only: a
   file of version 2 is upgraded without it);
7. anything else is ``forward``: the step's data (a batch made or prepared for the next
   micro-batch after the last one's backward), the loss kept for logging.

Under gradient accumulation a micro-batch therefore begins with its first out-of-place call on its
data or its first module call; what the code does in between on gradients, parameters, optimizer
state and in place is ``optimizer``.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from tracer.model.records import BackwardRun, Call, TensorRecord
from tracer.model.trace import Trace

# The note a trace carries when an optimizer stepped with a closure (LBFGS, Lightning's automatic
# optimization): the closure runs a forward and backward inside the step, so the step's ops are
# recorded one by one, not as one call of kind ``optimizer`` ({cls}: the optimizer's class).
_CLOSURE_STEP_MARK = ".step(closure) ran: "
CLOSURE_STEP_NOTE = ("{cls}" + _CLOSURE_STEP_MARK + "a step with a closure runs the closure's forward and backward "
                     "inside it, so its ops are recorded one by one (its updates of the parameters in the "
                     "optimizer phase), not as one optimizer call")


def stepped_with_closure(trace: Trace) -> bool:
    """Whether an optimizer of ``trace`` stepped with a closure (its note, ``CLOSURE_STEP_NOTE``):
    its backward runs are the closure's evaluations, not micro-batches."""
    return any(_CLOSURE_STEP_MARK in note for note in trace.notes)

# Calls that write every byte of their first argument without reading any (initialisers and
# fills, by their short name). The recorder's naming: a tensor first met as their target is not
# hashed before they run (tracer.record.tensor_names).
OVERWRITING = frozenset({"uniform_", "normal_", "zero_", "fill_", "random_", "bernoulli_", "exponential_",
                         "geometric_", "log_normal_", "cauchy_", "kaiming_uniform_", "kaiming_normal_",
                         "xavier_uniform_", "xavier_normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                         "orthogonal_", "sparse_", "eye_", "dirac_"})
# Rule 6: in-place calls that replace what they write rather than update it from its old value
# (``copy_`` reads only its source).
_REPLACING = OVERWRITING | {"copy_"}


def replaces_whole(api: str) -> bool:
    """Whether the call ``api`` (``Tensor.fill_``, ``torch.nn.init.zeros_``) overwrites the tensor
    it writes without reading its old value (rule 6 passes it by)."""
    return api.rpartition(".")[2] in _REPLACING


# Roles of values that belong to the model's state rather than to the step's data (rule 5).
STATE_ROLES = frozenset({"grad", "param", "buffer", "state"})
# Files of torch's own optimizer-side code (rule 6): a call they make after a backward is optimizer
# work even when it reads nothing the trace knows as state (GradScaler's inverse scale).
_OPTIMIZER_CODE = ("/torch/amp/", "/torch/cuda/amp/", "/torch/optim/", "/torch/nn/utils/clip_grad.py")


def is_optimizer_code(filename: str) -> bool:
    """Whether ``filename`` is torch's optimizer, AMP or gradient-clipping code (rule 6)."""
    path = filename.replace("\\", "/")
    return any(part in path for part in _OPTIMIZER_CODE)


def reads_model_state(in_names: Iterable[str], tensors: dict[str, TensorRecord],
                      optimizer_calls: Container[str], window: bool = True, writes: bool = False) -> bool:
    """Rule 5: whether a call reads optimizer state, the gradient of model state, a value an
    optimizer-phase call made, or a parameter or buffer while the optimizer window is open
    (``window``) or writing in place (``writes``). Not model state: the gradients that
    ``torch.autograd.grad`` returns and the ``.grad`` of a tensor a call of the block made (an
    input made from the step's data: FGSM's ``x.grad.sign()``), and, before any backward run of
    the step, a parameter only read (a frozen weight's ``.view`` at the top of a step)."""
    for n in in_names:
        rec = tensors.get(n)
        if rec is None:
            continue
        role = rec.role
        if rec.producer in optimizer_calls or role == "state" or (role == "grad" and _gradient_of_state(rec, tensors)):
            return True
        if (window or writes) and (role == "param" or role == "buffer"):
            return True
    return False


def _gradient_of_state(rec: TensorRecord, tensors: dict[str, TensorRecord]) -> bool:
    """Whether the gradient ``rec`` belongs to the model's state: not one ``torch.autograd.grad``
    returned (``<run>:out<i>``, made by the run), nor the ``.grad`` (``<t>@grad``) of a tensor a
    call of the block made."""
    name, producer = rec.name, rec.producer
    if producer is not None and name.startswith(producer) and name[len(producer):len(producer) + 4] == ":out":
        return False
    of, sep, _ = name.partition("@grad")
    if not sep:
        return True
    target = tensors.get(of)
    return target is None or target.role != "output"


def upgrade_phases(trace: Trace) -> int:
    """Apply the rules to a trace of format version 2, whose calls are ``forward`` or ``backward``;
    returns how many became ``optimizer``. What the file cannot tell is approximated: a call of
    the root module's own forward and a call outside every module both have module ``""``, so
    rule 3 sees only calls with a module path; rule 6's code test reads the call's stack."""
    tensors = trace.tensors
    calls = {c.name: c for c in trace.calls}
    ends = sorted(_run_start(run, tensors, calls) for run in trace.backward_runs if run.parent is None)
    optimizer_calls: set[str] = set()
    window = False
    next_end = 0
    for call in trace.calls:  # (sorted by seq: the order they began)
        while next_end < len(ends) and ends[next_end] < call.seq:
            window = True  # (a forward-phase call after a run began ran after it ended)
            next_end += 1
        if call.phase != "forward":
            continue
        if call.kind == "optimizer":
            call.phase = "optimizer"
        elif call.module:
            window = False
        elif any(r is not None and r.requires_grad for r in (tensors.get(o) for o in call.outputs)):
            continue
        elif reads_model_state(call.inputs, tensors, optimizer_calls, window, bool(call.mutated)) or (
                window and ((call.mutated and not replaces_whole(call.api)) or _made_by_optimizer_code(trace, call))):
            call.phase = "optimizer"
        if call.phase == "optimizer":
            optimizer_calls.add(call.name)
    return len(optimizer_calls)


def _run_start(run: BackwardRun, tensors: dict[str, TensorRecord], calls: dict[str, Call]) -> float:
    """Where a run began among the calls: recorded (``at``), else just after the call that made
    its first root (the loss it started from), else at the end."""
    if run.at is not None:
        return run.at - 0.5
    for root in run.roots:
        rec = tensors.get(root)
        call = calls.get(rec.producer) if rec is not None and rec.producer else None
        if call is not None:
            return call.seq + 0.5
    return float("inf")


def _made_by_optimizer_code(trace: Trace, call: Call) -> bool:
    if call.stack_id is None or not 0 <= call.stack_id < len(trace.stacks):
        return False
    frames = trace.frames
    return any(0 <= f < len(frames) and is_optimizer_code(frames[f].file) for f in trace.stacks[call.stack_id])


__all__ = ["CLOSURE_STEP_NOTE", "STATE_ROLES", "is_optimizer_code", "reads_model_state", "stepped_with_closure", "upgrade_phases"]
