"""A leaf's ``.grad`` in the backward (a part of the graph): the gradient reaching a leaf's
accumulator, the leaf's ``.grad`` before the accumulator ran and what it became."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from tracer.model import NodeRun, names
from tracer.record.part import Part
from tracer.record.tensors import version_of

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder


class LeafGrads(Part):
    """Names of the leaves' ``.grad`` values a backward makes (a part of the graph, ``Graph``).
    Owns what each accumulator's leaf's ``.grad`` was before the accumulator ran."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(rec)
        self._trace = rec.trace
        # Accumulator running now -> the name of its leaf's .grad before it ran (None: no .grad).
        self._grad_before: dict[str, str | None] = {}
        # A .grad the trace has no name for (from before the block), of an accumulator hooked
        # alone, is named only if its accumulator runs: the value then (weakly) and its version.
        self._grad_unnamed: dict[str, tuple[weakref.ref[torch.Tensor], int]] = {}
        # Accumulators whose leaf's .grad was named in a post-accumulate-grad hook because code
        # the trace cannot see writes it next (read_before_unseen_write): their own hook, which
        # runs after those writes, leaves the name as it is.
        self._written_unseen: set[str] = set()

    def forget(self, t: torch.Tensor) -> None:
        """Drop the references to ``t`` (see ``Graph.forget_tensor``)."""
        for acc in [a for a, (r, _) in self._grad_unnamed.items() if r() is t]:
            del self._grad_unnamed[acc]

    # ---- a leaf's .grad -------------------------------------------------------------------------
    # The gradient a backward run brings to a leaf ``p`` is ``p@grad`` (``p@grad#k`` in the k-th
    # run). When the leaf had no .grad, that gradient becomes its .grad (the very tensor, or a copy
    # of the same bytes), so .grad carries that name. When .grad existed, the run adds into it:
    # in place, a new version ``<.grad's name>@v<n>``; out of place (create_graph), likewise a new
    # version of ``p@grad``. A .grad from before the block, first seen here, is ``p@grad@v0``.
    def _grad_of_leaf(self, acc: str) -> torch.Tensor | None:
        var = self.rec.graph.leaf_of(acc)
        return None if var is None else var.grad

    def name_incoming(self, acc: str, step: NodeRun, grads: tuple[Any, ...]) -> None:
        """The gradient reaching a leaf's accumulator is that leaf's gradient, ``p@grad``, even when
        the same tensor already has another name (passed through unchanged: ``(a + b)`` hands one
        tensor to both accumulators): it is then recorded under that name too."""
        slot = self.rec.graph.slot_grad(acc, 0)
        g = grads[0] if grads else None
        if slot is None or not isinstance(g, torch.Tensor) or not step.grads_in or step.grads_in[0] == slot:
            return
        if slot in self._trace.tensors:  # already recorded in this run (cannot happen twice): keep it
            return
        # The value as it arrives (what the leaf's own hooks returned, when it has some: made
        # by the hook's call), with that record's checksum and stats.
        incoming = step.grads_in[0]
        known = self._trace.tensors.get(incoming) if incoming is not None else None
        step.grads_in[0] = self.rec.names.new_tensor(g, slot, "grad", known.producer if known is not None else None,
                                            same_as=known if known is not None and version_of(g) == known.version
                                            else None)

    def note_grad_before(self, acc: str) -> None:
        """Pre-hook of an accumulator: the name of its leaf's .grad before the run adds to it."""
        g = self._grad_of_leaf(acc)
        if g is None:
            self._grad_before[acc] = None
            return
        hit = self.rec.names.lookup(g)
        if hit is not None and hit[1] == version_of(g):
            self._grad_before[acc] = hit[0]
        elif hit is not None:  # changed where the trace could not see it
            self._grad_before[acc] = self.rec.names.name_at(g, version_of(g))
        else:
            base = f"{self.rec.graph.leaf_name(acc)}@grad"
            self._grad_before[acc] = self.rec.names.new_leaf_grad(g, names.version_name(base, 0), None, None)
        # The accumulator adds into an existing .grad in place (whoever else holds it), with no
        # op the recorder sees: a value of it still waiting for its checksum is read first.
        self.rec.hasher.before_write([g])

    def note_grads_before(self, accs: Iterable[str], create_graph: bool, skip: str | None = None) -> list[str]:
        """At a backward's start, for each accumulator hooked alone: its leaf's .grad, which it may
        add into (note_grad_before, done here instead of in a pre-hook). A .grad without a name
        is named only when its accumulator runs (name_grad_from_before), unless this run
        makes a graph (``create_graph``: it then adds out of place, and the old value may be
        gone by then). ``accs``: the accumulators hooked alone.
        Returns the accumulators whose leaf has a post-accumulate-grad hook now: they need
        their pre-hook after all (see _hook_accumulator_starts)."""
        late: list[str] = []
        graph = self.rec.graph
        for acc in accs:
            if acc == skip:
                continue
            var = graph.leaf_of(acc)
            if var is not None and getattr(var, "_post_accumulate_grad_hooks", None) is not None:
                late.append(acc)
            g = var.grad if var is not None else None
            self._grad_unnamed.pop(acc, None)
            if g is None:
                self._grad_before.pop(acc, None)
                continue
            hit = self.rec.names.lookup(g)
            if hit is not None and hit[1] == version_of(g):
                self._grad_before[acc] = hit[0]
            elif hit is None and not create_graph:
                self._grad_before.pop(acc, None)
                self._grad_unnamed[acc] = (weakref.ref(g), version_of(g))
            else:
                self.note_grad_before(acc)
        return late

    def infer_grad_before(self, acc: str) -> None:
        """An accumulator hooked alone ran before the trace knew a backward had started (one
        started where the trace could not see it): its .grad before is read from what it is
        now. Unnamed and changed in place (version above 0: a copy or the gradient itself
        would be at 0), it is a .grad from before the block that the accumulator added into.
        (A named one needs nothing: name_accumulated sees its version change.)"""
        g = self._grad_of_leaf(acc)
        if g is not None and self.rec.names.lookup(g) is None and version_of(g) > 0:
            self._grad_unnamed[acc] = (weakref.ref(g), version_of(g) - 1)

    def name_grad_from_before(self, acc: str) -> None:
        """An accumulator hooked alone has run on a .grad that had no name at the backward's
        start: that value is ``p@grad@v0`` (as note_grad_before would have named it), recorded
        now with the version it had then."""
        pending = self._grad_unnamed.pop(acc, None)
        if pending is None:
            return
        old, version = pending[0](), pending[1]
        g = old if old is not None else self._grad_of_leaf(acc)
        if g is None:
            return
        name = self.rec.names.new_leaf_grad(g, names.version_name(f"{self.rec.graph.leaf_name(acc)}@grad", 0), None,
                                        None)
        self._trace.tensors[name].version = version
        # The old value itself (added into in place), else the new .grad that replaced it (added
        # out of place), which is not that value: its version -1 makes name_accumulated see a
        # new version of this name in it.
        self.rec.names.set_name(g, name, version if old is not None else -1)
        self._grad_before[acc] = name

    def name_accumulated(self, acc: str, step: NodeRun | None) -> None:
        """Hook of an accumulator (it has run): give its leaf's .grad its name."""
        before = self._grad_before.pop(acc, None)
        if acc in self._written_unseen:  # named before the unseen writes: see read_before_unseen_write
            self._written_unseen.discard(acc)
            return
        g = self._grad_of_leaf(acc)
        if g is None:
            return
        ver = version_of(g)
        hit = self.rec.names.lookup(g)
        if hit is not None:
            if hit[1] != ver:  # accumulated in place
                base = names.base_name(hit[0])
                self.rec.names.new_leaf_grad(g, self.rec.names.bump(base), acc, hit[0])
            return  # else: the incoming gradient itself, already named
        incoming = step.grads_in[0] if step is not None and step.grads_in else None
        if before is None and incoming is not None:
            # A copy of the incoming gradient (it was still referenced, so not stolen): the same
            # bytes under the same name.
            self.rec.names.set_name(g, incoming, ver)
            self.rec.names.index_alias(g)
            return
        base = f"{self.rec.graph.leaf_name(acc)}@grad"  # added out of place into the old .grad
        self.rec.names.new_leaf_grad(g, self.rec.names.bump(base) if base in self._trace.tensors else base, acc, before)

    def name_leaf_grad(self, t: torch.Tensor, acc: str, step: NodeRun | None) -> str | None:
        """A tensor seen for the first time while the accumulator ``acc`` runs (a post-accumulate-
        grad hook reading .grad; ``step``: its run): the .grad the accumulator has just made,
        named as its hook would."""
        if self._grad_of_leaf(acc) is not t:
            return None
        self.name_accumulated(acc, step)
        hit = self.rec.names.lookup(t)
        # What the accumulator's own hook will find: .grad named, unchanged since.
        self._grad_before[acc] = None if hit is None else hit[0]
        return None if hit is None else hit[0]

    def read_before_unseen_write(self, acc: str, step: NodeRun | None) -> torch.Tensor | None:
        """A post-accumulate-grad hook of ``acc``'s leaf: the accumulator has run, its own hook
        has not, and code the trace cannot see writes the leaf's .grad in place in between (DDP's
        reducer with ``gradient_as_bucket_view``: its autograd hook on the accumulator, which runs
        before gradtrace's, divides the gradient and starts its bucket's all-reduce, whose writes
        move no version counter). The accumulated value is named now (the caller reads it before
        those writes), and the accumulator's hook leaves that name alone: the next version is
        whoever records those writes (DDP's record, when the backward ends). Returns the .grad."""
        g = self._grad_of_leaf(acc)
        if g is None:
            return None
        self.name_accumulated(acc, step)
        self._written_unseen.add(acc)
        return g
