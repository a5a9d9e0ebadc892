"""Tensor names (a part of the recorder): the name of every tensor value a trace meets, its
versions, the aliases that share its bytes, the paths of parameters, buffers and optimizer state,
and the record of each value (``TensorRecord``), handed to the hasher.

``TensorNames`` owns the tables that map a live tensor (weakly, by identity) to its name and
version, the parameters, buffers and state named by path, the storages of aliased tensors and
the version counter of every name. The other parts ask it for names (``name_of``, ``name_at``,
``lookup``) and have it record new values (``new_tensor``, ``bump``); how a parameter met early
finds its model is ``module_roots``/``owners``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tracer.model import TensorRecord, names
from tracer.model.phases import OVERWRITING
from tracer.model.records import OWNED_ROLES, Role
from tracer.record.checksums.hasher import BATCH_MIN
from tracer.record.effects import RESIZING_APIS, SET_DATA_API, UNINITIALISED, writes_whole
from tracer.record.identity import identity
from tracer.record.module_roots import name_in_callers, parameter_path, swaps_parameters
from tracer.record.owners import constructing_a_module, needs_search, owning_root_module
from tracer.record.part import Part
from tracer.record.tensors import (
    DEVICE_NAMES,
    DTYPE_NAMES,
    RAGGED_NOTE,
    REORDERED,
    SAME_ORDER,
    VIEW_OPS,
    device_name,
    dtype_name,
    indexed_storage_key,
    plain_sizes,
    same_elements,
    same_multiset,
    same_values,
    same_view,
    storage_id,
    storage_key,
    version_of,
)
from tracer.record.transforms import current_transform, transforms_active, transforms_off, unwrap
from tracer.record.weakmap import IdWeakMap

# Why a tensor in memory a storage was just given is not hashed (TensorNames.fresh_storage).
FRESH_NOTE = ("not hashed: uninitialised memory (its storage was resized from nothing inside the block, as "
              "FSDP gives an unsharded parameter its memory back, and nothing recorded has written it since)")

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder

# Searches of the live objects for a parameter's model per trace (each one gc pass; see owners.py).
MAX_OWNER_SEARCHES = 4

# Whether a root module's parameters and buffers are read ahead, in one go, when it is first
# called (see TensorNames._read_state_ahead); a switch for benchmarks/lever_ab.py.
READ_STATE_AHEAD = True

# Ops that return a new tensor object on their input's bytes and version counter, with no
# ``_base`` (``Tensor.detach``, ``torch.ops.aten.alias``): see name_call_values.
DETACHING = frozenset({"detach", "alias"})

# Roles a value keeps through an in-place write (else its new version is the writing call's output).
_KEPT_ON_WRITE: frozenset[str] = OWNED_ROLES | {"grad"}


@dataclass
class Held:
    """What the names knew of one tensor object, taken off it for ``torch.utils.swap_tensors``."""

    name: tuple[str, int] | None  # (name, version) of the value it held
    owned: tuple[str, Any] | None  # (path, role) of the object, for a parameter, buffer or state
    alias_keys: list[int] = field(default_factory=list)  # storages it was indexed under


class TensorNames(Part):
    """The names of one trace's tensor values (a part of ``Recorder``)."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(rec)
        self._trace = rec.trace
        # Whether values are read at all (checksums or stats): only then is a view worth telling
        # apart from a new value (see same_values_input; the names+links+stacks trace skips it).
        self.reads_values = rec.hasher.active
        # Stats and no checksums: a transposed view of a contiguous value has that value's stats
        # (same_multiset), so it copies them too.
        self._stats_only = rec.options.hash == "none" and rec.options.effective_stats
        # Set while a call with many new values is being recorded: their (record, tensor) pairs,
        # handed to Hasher.submit_many when the call's records are all made.
        self._deferred: list[tuple[TensorRecord, torch.Tensor]] | None = None
        self._tensor_names: IdWeakMap[tuple[str, int]] = IdWeakMap()  # tensor -> (name, version)
        # ``lookup(t)``: (name, version) of the value ``t`` showed when it was last named, or None.
        # The bound method itself: every recorded call asks it for each of its inputs.
        self.lookup = self._tensor_names.get
        self._interned: dict[tuple[int, ...], tuple[int, ...]] = {}  # shapes and strides of records
        self._named: IdWeakMap[tuple[str, Role]] = IdWeakMap()  # param/buffer/state -> (name, role)
        # What p.grad or p.data returned before the parameter p was named -> (p, "grad"/"data"):
        # named when a call first uses it (see name_grad_alias, name_data_alias).
        self._read_before_named: IdWeakMap[tuple[torch.Tensor, str]] = IdWeakMap()
        # Parameters and buffers read when their root module was named, before any call used
        # them (see _read_state_ahead) -> (the version read, the record the reads went to).
        self._read_ahead: IdWeakMap[tuple[int, TensorRecord]] = IdWeakMap()
        self._reading_ahead = False  # whether anything was read ahead
        self._aliases: dict[int, list[weakref.ref[torch.Tensor]]] = {}  # storage -> tensors
        self._versions: dict[str, int] = {}  # the last version of each base name
        self._tensor_seq = 0
        self._inputs = 0
        # Byte spans of storages given memory inside the block (``UntypedStorage.resize_`` from
        # nothing: FSDP before a layer's backward) and not written by a recorded call since: a
        # tensor in one, seen now, holds whatever the allocator left there (see fresh_storage).
        self._fresh: list[tuple[int, int]] = []
        self._owner_searches = 0  # passes over the live objects made for this trace (see name_model_of)
        self._uninitialised = 0  # records made of uninitialised memory (see _view_of_unwritten)
        # The plain tensors that outputs recorded inside a torch.func transform wrap (vmap's
        # batched values) -> their (name, version): the tensor a transform hands back is one.
        self._unwrapped: IdWeakMap[tuple[str, int]] = IdWeakMap()

    # ---- a call's values ----------------------------------------------------------------------
    def name_inputs(self, ins: list[torch.Tensor], versions: list[int], short: str,
                    out_only: set[int] | None = None) -> list[str]:
        """The names of a call's inputs, whose versions the caller has just read, before its op
        runs (the caller holds the lock). What the op overwrites without reading it, met here
        first, is recorded as such (``name_at``'s ``overwritten_by``): the first input of an
        initialiser, and ``out_only``, the identities of the tensors passed only as ``out=``
        (an ``out=`` argument is written whole and never read; FSDP copies each unsharded
        parameter out of the all-gather into memory it has just given back to the parameter)."""
        # A list of exactly the right length (not grown by appends): it is kept in the Call.
        in_names = [""] * len(ins)
        known = self.lookup
        for i, t in enumerate(ins):
            hit = known(t)  # name_at's usual outcome inlined: a tensor named before, unchanged
            if hit is not None and hit[1] == versions[i]:
                in_names[i] = hit[0]
            elif out_only and identity(t) in out_only:
                in_names[i] = self.name_at(t, versions[i], f"{short} (its out= argument)")
            else:
                in_names[i] = self.name_at(t, versions[i], short if i == 0 and short in OVERWRITING else None)
        return in_names

    def name_call_values(self, api: str, short: str, kind: str, name: str, ins: list[torch.Tensor],
                         in_names: list[str], outs: list[torch.Tensor], mutated: list[torch.Tensor],
                         produced: list[torch.Tensor], wrote_out: bool = False,
                         ) -> tuple[list[str], list[str], dict[int, str]]:
        """The names of what the call ``name`` wrote (a new version of each, through every alias
        that shares its bytes) and returned (an input returned unchanged keeps its name; a new
        value is ``<call>:out<i>``), recorded. Returns the names of ``mutated``, of ``produced``
        (what it returned, then what it wrote without returning it) and of every value it
        touched, by identity (the caller holds the lock). ``wrote_out``: the call was passed
        ``out=`` (what it wrote it wrote whole)."""
        # Inputs by identity, for what the call wrote or returned unchanged: built only where a
        # scan of the inputs could cost more (by C calls: a comprehension is a Python frame).
        in_pos = dict(zip(map(identity, ins), range(len(ins)))) if mutated or len(ins) > 4 else None
        names_of: dict[int, str] = {}
        # A call with many new values (an optimizer step, a foreach op) hands them to the
        # hasher together: it reduces the small ones of one size in one go.
        deferred = len(mutated) + len(outs) >= BATCH_MIN and self.defer_submits()
        try:
            # Lists of exactly the right length, filled in place (they are kept in the Call).
            mutated_names = [""] * len(mutated)
            through: list[str] = []  # new versions of aliases of what it wrote (a view's base)
            if mutated:
                assert in_pos is not None
                through = self._name_written(api, kind, name, ins, in_names, mutated, in_pos, names_of,
                                             mutated_names, wrote_out)
            uninit = short in UNINITIALISED
            n_outs = len(outs)
            out_names = [""] * n_outs
            lookup = self.lookup
            for i, t in enumerate(outs):
                key = identity(t)
                known = names_of.get(key)
                if known is None and ins:  # returned an input unchanged (x.to(x.dtype))
                    if in_pos is not None:
                        if key in in_pos:
                            known = in_names[in_pos[key]]
                    else:
                        for x, xname in zip(ins, in_names):
                            if x is t:
                                known = xname
                                break
                if known is None and kind != "function":
                    # A custom Function's outputs are the very tensors its forward's inner ops
                    # made, but as the Function's outputs they carry its grad node: they are
                    # named by the Function (MyFn0:out), not by the op inside it.
                    hit = lookup(t)
                    if hit is not None and hit[1] == version_of(t):
                        known = hit[0]
                if known is None:
                    unwritten = uninit or (bool(self._uninitialised and ins) and self._view_of_unwritten(t, name))
                    known = self.new_tensor(t, names.output_name(name, i, n_outs), "output", name,
                                            uninitialized=unwritten,
                                            same_as=self.same_values_input(t, short if kind == "op" else "", ins,
                                                                           in_names, names_of)
                                            if ins and not unwritten and self.reads_values else None)
                names_of[key] = known
                out_names[i] = known
        finally:
            if deferred:
                self.submit_deferred()
        if outs and current_transform() is not None:
            self.note_unwrapped(outs, out_names)
        if len(produced) > n_outs:
            # What it wrote without returning it (foreach in-place ops, GradScaler's unscale
            # return nothing) is among its outputs too.
            out_names += [names_of[identity(t)] for t in produced[n_outs:]]
        if through:
            out_names += [n for n in through if n not in out_names]  # (and what it wrote through an alias)
        if short in DETACHING and kind == "op" and ins and n_outs == 1 and same_view(ins[0], outs[0]):
            # ``y.detach()``: a new tensor object on y's bytes and version counter, without a
            # ``_base`` to lead a write back to y. Both indexed (outputs of calls are not, see
            # index_alias), so that ``y.detach().zero_()`` is a new version of y too, made by
            # that call, and a write into y one of the detached tensor.
            self._index_pair(ins[0], outs[0])
        return mutated_names, out_names, names_of

    def _name_written(self, api: str, kind: str, name: str, ins: list[torch.Tensor], in_names: list[str],
                      mutated: list[torch.Tensor], in_pos: dict[int, int], names_of: dict[int, str],
                      mutated_names: list[str], wrote_out: bool = False) -> list[str]:
        """A new version of each tensor the call ``name`` wrote, and of every named tensor that
        shares its bytes; returns the names of the latter (written through an alias)."""
        tensors = self._trace.tensors
        versions = self._versions
        if self._fresh:  # written by a recorded call: its bytes are that call's from now on
            self._fresh = [span for span in self._fresh if not any(self._within(t, span) for t in mutated)]
        # Foreach ops and optimizer steps never resize, restride or retype a tensor.
        same_meta = kind == "optimizer" or api.startswith("torch._foreach_")
        for j, t in enumerate(mutated):  # an optimizer's foreach op changes ~150 at once
            old = in_names[in_pos[identity(t)]]
            old_rec = tensors.get(old)
            # A written parameter, buffer, state or gradient stays one (``clip_grad_value_`` clamps
            # each ``.grad`` in place: its new version is still the gradient, not a call's output).
            role = old_rec.role if old_rec is not None and old_rec.role in _KEPT_ON_WRITE else "output"
            head, sep, tail = old.rpartition("@v")  # names.base_name(old), inlined
            base = head if sep and tail.isdigit() else old
            n = versions.get(base, 0) + 1
            versions[base] = n
            # Memory nobody wrote stays so after a write of part of it; a resize can make some.
            uninit = (self._still_uninitialised(api, name, wrote_out, t.numel(), old_rec.numel)
                      if old_rec is not None and old_rec.uninitialized
                      else api in RESIZING_APIS and self._grown(t, old_rec, name))
            new = self.new_tensor(t, names.version_name(base, n), role, name, previous=old,
                                  like=old_rec if same_meta and not uninit else None, uninitialized=uninit)
            names_of[identity(t)] = new
            mutated_names[j] = new
        if api == SET_DATA_API:
            # Its new bytes are the value's; no other tensor's bytes changed.
            self.index_alias(mutated[0])
            return []
        return self.write_through_aliases(mutated, names_of, name, ins, api, wrote_out)

    def _view_of_unwritten(self, t: torch.Tensor, call: str) -> str | bool:
        """The note of ``t``, made by ``call``, when it is a view of a value that holds
        uninitialised memory (``torch.empty(6)[:3]`` before anything is written there), else
        False: also for a view of what ``call`` itself partly wrote, which it returns as the part
        it wrote. Asked only once such a value has been recorded."""
        base = t._base
        if base is None:
            return False
        hit = self._tensor_names.get(base)
        if hit is None or hit[1] != version_of(base):
            return False
        rec = self._trace.tensors.get(hit[0])
        # (a view the writing call itself returns is what it wrote: FSDP2's copy-in returns its slice)
        if rec is None or not rec.uninitialized or rec.producer == call:
            return False
        return f"not hashed: a view of {rec.name}, which holds uninitialised memory; its first write is a new version"

    @staticmethod
    def _still_uninitialised(api: str, call: str, wrote_out: bool, written: int, numel: int) -> str | bool:
        """For a value that held uninitialised memory, written by ``call`` (``written`` of its
        ``numel`` elements: fewer through a view): the note of a new version that still holds
        some of it (the rest is whatever the allocator left, so two runs of the same program
        differ there), else False: a write of every element (``out=``, a fill, ``copy_``, an
        initialiser, a collective's received output)."""
        if (wrote_out or writes_whole(api)) and written >= numel:
            return False
        return (f"not hashed: it still holds uninitialised memory ({call} wrote part of it, or wrote it from what "
                "it held); its first whole write is a new version")

    @staticmethod
    def _grown(t: torch.Tensor, old: TensorRecord | None, call: str) -> str | bool:
        """For a resize (``call``) that wrote ``t``: the note of a value that holds uninitialised
        memory (it has more elements than before: the new ones are whatever the allocator left,
        so two runs of the same program differ there), else False."""
        if old is None or t.numel() <= old.numel:
            return False
        return (f"not hashed: {call} grew it from {old.numel} to {t.numel()} elements, the new ones "
                "uninitialised memory; its first write is a new version")

    # ---- what the other parts ask ------------------------------------------------------------
    def set_name(self, t: torch.Tensor, name: str, version: int) -> None:
        """``t`` shows the value named ``name`` at ``version`` (no record made)."""
        self._tensor_names[t] = (name, version)

    def owned_name(self, t: torch.Tensor) -> tuple[str, Role] | None:
        """The path and role of a parameter, buffer, state or ``.grad`` named by its place."""
        return self._named.get(t)

    def own(self, t: torch.Tensor, name: str, role: Role) -> None:
        """``t`` is named by its place: ``name`` (a path, ``<param>@grad``) in ``role``."""
        self._named[t] = (name, role)

    def last_version(self, base: str) -> int:
        """The last version number given to ``base`` (0: none yet)."""
        return self._versions.get(base, 0)

    def new_leaf_grad(self, g: torch.Tensor, name: str, producer: str | None, previous: str | None) -> str:
        """Record ``g``, a leaf's ``.grad``, as ``name`` (indexed by storage: ``.grad`` is written
        through aliases, an optimizer's foreach ops)."""
        name = self.new_tensor(g, name, "grad", producer, previous=previous)
        self.index_alias(g)
        return name

    def add_copy(self, original: TensorRecord, name: str, producer: str) -> TensorRecord:
        """A record of ``original``'s value under another name (a gradient passed on unchanged
        along another edge), its checksum and stats copied once known."""
        # Positional, in TensorRecord's field order (dataclasses.replace reads the fields anew
        # each time: a backward passes ~170 gradients on unchanged in a GPT-2 step).
        o = original
        rec = TensorRecord(name, o.shape, o.dtype, o.device, "grad", producer, o.stride, o.contiguous,
                           o.requires_grad, o.version, self._tensor_seq, None, None, None, None, None,
                           o.uninitialized, o.sharding, o.values)
        self._tensor_seq += 1
        self._trace.tensors[name] = rec
        self.rec.hasher.same_as(rec, original)
        return rec

    def take_off(self, t: torch.Tensor) -> Held:
        """Take every weak reference of the names to ``t`` off (``swap_tensors`` refuses a tensor
        that has one), keeping what they said."""
        held = Held(self._tensor_names.pop(t), self._named.pop(t))
        self._read_before_named.pop(t)
        for key, refs in self._aliases.items():
            if any(r() is t for r in refs):
                refs[:] = [r for r in refs if r() is not t]
                held.alias_keys.append(key)
        return held

    def put_back(self, t: torch.Tensor, own: Held, value: Held) -> None:
        """After a swap: ``t`` keeps its own place (``own``) and shows ``value``'s name."""
        if own.owned is not None:
            self._named[t] = own.owned
        if value.name is not None:
            self._tensor_names[t] = value.name
        for key in value.alias_keys:
            self._aliases.setdefault(key, []).append(weakref.ref(t))

    # ---- tensors ------------------------------------------------------------------------------
    def new_tensor(self, t: torch.Tensor, name: str, role: Role, producer: str | None,
                    previous: str | None = None, like: TensorRecord | None = None,
                    uninitialized: bool | str = False, same_as: TensorRecord | None = None) -> str:
        """Record a new tensor value. ``like``: the record of the version this one replaced,
        when the call cannot have changed shape, strides, dtype or device (foreach in-place
        ops): its metadata is reused instead of read again (an optimizer step makes ~10 new
        versions of every parameter and state tensor). ``uninitialized``: memory nobody wrote
        (``torch.empty_like``): recorded, never hashed (a string: the note saying why, else
        "made by ``producer``"). ``same_as``: the record of a value
        this one reads as (``_reads_as``: a view of it): its checksum and stats are copied from
        that record, not computed again."""
        if name in self._trace.tensors:  # (untaken's usual outcome inlined: a name not taken yet)
            name = self.untaken(name)
        if like is not None:
            try:
                ver = t._version
            except RuntimeError:  # inference tensors have no version counter
                ver = 0
            rec = TensorRecord(name, like.shape, like.dtype, like.device, role, producer, like.stride,
                               like.contiguous, like.requires_grad, ver, self._tensor_seq, None, None, None,
                               None, previous)
            return self._add_record(rec, t, ver, same_as)
        try:
            stride: tuple[int, ...] | None = t.stride()
            contiguous = t.is_contiguous()
        except RuntimeError:  # sparse and other layouts have no strides
            stride, contiguous = None, False
        # Shapes and strides repeat across a step: one tuple per distinct value, not two fresh
        # tuples per record (memory, and fewer objects for the garbage collector to visit).
        interned = self._interned
        ragged = False
        try:
            size = t.shape
            shape = interned.get(size)
            if shape is None:  # a shape not met before: plain ints only (SymInts hash too)
                shape = tuple(size)
                if not all(type(v) is int for v in shape) or (
                        stride is not None and not all(type(v) is int for v in stride)):
                    raise TypeError("symbolic sizes")
                interned[shape] = shape
            if stride is not None:
                stride = interned.setdefault(stride, stride)
        except (TypeError, RuntimeError):
            # Symbolic sizes (not hashable) and nested tensors (a strided one has no sizes at
            # all; a jagged one has a symbolic ragged size): plain ints in the record, 0 where a
            # size is not one number (JSON, and every reader, needs ints).
            shape, stride, ragged = plain_sizes(t, stride)
        if stride is not None and type(stride) is not tuple:
            stride = tuple(stride)
        try:
            ver = t._version
        except RuntimeError:  # inference tensors have no version counter
            ver = 0
        dtype = DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype)
        device = DEVICE_NAMES.get(t.device) or device_name(t.device)
        # Positional (the field order of TensorRecord): keyword binding cost as much as the rest.
        rec = TensorRecord(name, shape, dtype, device, role, producer, stride, contiguous, t.requires_grad, ver,
                           self._tensor_seq, None, None, None, None, previous)
        if uninitialized:
            self._uninitialised += 1
            rec.uninitialized = True
            rec.hash_note = uninitialized if isinstance(uninitialized, str) else (
                f"not hashed: uninitialised memory (made by {producer}); its first write is a new version")
        elif ragged:
            rec.hash_note = RAGGED_NOTE
            self._tensor_seq += 1
            self._trace.tensors[rec.name] = rec
            self._tensor_names[t] = (rec.name, ver)
            return rec.name
        return self._add_record(rec, t, ver, same_as)

    @contextlib.contextmanager
    def submits_batched(self) -> Iterator[None]:
        """Within: the new values' tensors go to the hasher together at the end (see _deferred)."""
        started = self.defer_submits()
        try:
            yield
        finally:
            if started:
                self.submit_deferred()

    def defer_submits(self) -> bool:
        """Start collecting the new values' tensors (False: nothing to hash, or already collecting)."""
        if not self.reads_values or self._deferred is not None:
            return False
        self._deferred = []
        return True

    def submit_deferred(self) -> None:
        batch, self._deferred = self._deferred, None
        if batch:
            self.rec.hasher.submit_many(batch)

    def untaken(self, name: str) -> str:
        """``name``, or ``name#k`` with the first k not taken: a record is never overwritten."""
        tensors = self._trace.tensors
        if name not in tensors:
            return name
        k = 1
        while f"{name}#{k}" in tensors:
            k += 1
        return f"{name}#{k}"

    def _add_record(self, rec: TensorRecord, t: torch.Tensor, ver: int,
                    same_as: TensorRecord | None = None) -> str:
        name = rec.name
        self._tensor_seq += 1
        self._trace.tensors[name] = rec
        self._tensor_names[t] = (name, ver)
        if rec.uninitialized:
            return name
        rec_ = self.rec
        hasher = rec_.hasher
        if hasher is rec_.own_hasher:
            # With nothing to hash or summarise, skip the call.
            if hasher.active:
                if same_as is not None:
                    hasher.same_as(rec, same_as)
                elif self._deferred is not None:  # submitted with the call's other values
                    self._deferred.append((rec, t))
                else:
                    hasher.submit(rec, t)
        else:
            # A stand-in (an async collective's outputs get a note instead of a checksum; kept
            # values see every tensor) is always handed the tensor itself.
            hasher.submit(rec, t)
        return name

    def same_values_input(self, t: torch.Tensor, short: str, ins: list[torch.Tensor], in_names: list[str],
                           changed: dict[int, str]) -> TensorRecord | None:
        """The record of an input of the call that made ``t`` and that ``t`` reads as (see
        ``_reads_as``): ``t`` gets that record's checksum and stats. ``short``: the op's short
        name (empty for anything but a torch op); ``changed``: inputs the call wrote (their old
        record is stale)."""
        base = t._base
        if base is None and short != "detach":  # (one attribute read for every other output)
            return None
        unwritten = ((x, xname) for x, xname in zip(ins, in_names) if identity(x) not in changed)
        return self.view_source(t, base, VIEW_OPS.get(short), unwritten)

    def view_source(self, t: torch.Tensor, base: torch.Tensor | None, order: str | None,
                     candidates: Iterable[tuple[Any, str | None]]) -> TensorRecord | None:
        """The record of the first named candidate tensor that the view ``t`` (of ``base``; None:
        an alias without one, ``detach``) reads as (``_reads_as``): a call's inputs for its
        outputs, a grad node's received gradients for the ones it made."""
        for x, xname in candidates:
            if xname is not None and isinstance(x, torch.Tensor) and (base is None or x is base or x._base is base) \
                    and self._reads_as(x, t, order):
                return self._trace.tensors.get(xname)
        return None

    def _reads_as(self, x: torch.Tensor, t: torch.Tensor, order: str | None) -> bool:
        """Whether ``t``, a view of ``x``'s bytes, has ``x``'s checksum and stats: it reads the same
        values in the same order, or, when only stats are taken, the same values in any order.
        ``order``: what the view's op (or grad node) does to the order of the elements
        (``tensors.VIEW_OPS``), None when not known: then only the layouts can tell."""
        if order is SAME_ORDER:
            return same_elements(x, t)
        if order is REORDERED:  # (a checksum reads the order: only a permutation that changes none)
            return same_elements(x, t) if self._stats_only else same_values(x, t)
        return same_values(x, t) or (self._stats_only and same_multiset(x, t))

    def name_of(self, t: torch.Tensor) -> str:
        """The current name of a tensor, registering it (and hashing it) on first sight."""
        return self.name_at(t, version_of(t))

    def name_at(self, t: torch.Tensor, version: int, overwritten_by: str | None = None) -> str:
        """``name_of`` for a tensor whose current version the caller has just read.
        ``overwritten_by``: the call about to run writes every byte of ``t`` without reading them
        (an initialiser: ``uniform_``, ``kaiming_uniform_``, ``fill_``)."""
        hit = self._tensor_names.get(t)
        if hit is not None:
            name, ver = hit
            if version == ver:
                return name
            leaf = self._accumulated_now(t, version)  # (added into in place: a post-accumulate-grad hook reads it)
            if leaf is not None:
                return leaf
            # Changed in place where the trace could not see it (untraced code, through .data).
            base = names.base_name(name)
            old = self._trace.tensors.get(name)
            return self.new_tensor(t, self.bump(base), old.role if old is not None else "input", None,
                                   previous=name, uninitialized=self._fresh_note(t))
        named = self._named.get(t)
        if named is not None:
            # A parameter first seen after code wrote its bytes through a live alias the trace
            # met first (an EMA helper's kept ``.data`` tensors, updated before the EMA model
            # runs): its record continues that alias's last version, whose bytes it holds.
            key, prior = self._indexed_alias(t)  # (the key read once: for the alias and for the index)
            if prior is not None:
                prior_name: str | None = self.name_of(prior)
                same = self._trace.tensors.get(prior_name) if prior_name is not None else None
            else:
                prior_name, same = None, None
                if self._reading_ahead:  # (a names + links + stacks trace reads nothing)
                    ahead = self._read_ahead.pop(t)
                    same = ahead[1] if ahead is not None and ahead[0] == version else None
            name = self.new_tensor(t, named[0], named[1], None, previous=prior_name, same_as=same)
            self.index_alias(t, key)
            return name
        leaf = self._accumulated_now(t, version)  # (made by it: a post-accumulate-grad hook reads it)
        if leaf is not None:
            return leaf
        if self._aliases:
            alias = self._alias_name(t, version)
            if alias is not None:
                return alias
        if type(t) is torch.nn.Parameter and self.name_model_of(t):
            return self.name_at(t, version)
        if len(self._read_before_named):
            read = self._read_before_named.get(t)
            if read is not None and self._name_read_before(t, *read):
                return self.name_at(t, version)
        through = self._through_transform(t)
        if through is not None:
            return through
        self._inputs += 1
        # Met first as what an initialiser or an out= overwrites (``nn.Parameter(torch.empty(...))``
        # in a constructor that runs in the block), or in memory nobody has written yet: not hashed.
        unwritten = (f"not hashed: first seen being overwritten by {overwritten_by}, which reads none of its "
                     "bytes; its new value is the next version") if overwritten_by is not None else self._fresh_note(t)
        name = self.new_tensor(t, f"input{self._inputs - 1}", "input", None, uninitialized=unwritten)
        if self.rec.in_backward and overwritten_by is None:
            self.rec.graph.note_unnamed_hook_input(name)
        self.index_alias(t)
        return name

    def note_unwrapped(self, outs: Sequence[torch.Tensor], out_names: Sequence[str]) -> None:
        """Values recorded inside a ``torch.func`` transform: the plain tensor each wraps is
        indexed by its name, so that what the transform hands back (that very tensor, the batch
        of every entry under ``vmap``) is read as the value it is, not as a new input."""
        with transforms_off():
            for t, name in zip(outs, out_names):
                plain, _ = unwrap(t)
                if plain is not None and plain is not t:
                    self._unwrapped[plain] = (name, version_of(plain))

    def _through_transform(self, t: torch.Tensor) -> str | None:
        """The name of the value ``t``, met for the first time, shows through a ``torch.func``
        transform: inside one, the named tensor a wrapper wraps (vmap's per-entry view of a
        batch the block made); after one, the output it handed back (see note_unwrapped)."""
        if len(self._unwrapped):
            hit = self._unwrapped.get(t)
            if hit is not None and hit[1] == version_of(t):
                self._tensor_names[t] = hit
                return hit[0]
        if not transforms_active():
            return None
        with transforms_off():
            plain, _ = unwrap(t)
            if plain is None or plain is t:
                return None
            hit = self._tensor_names.get(plain)
            if hit is None or hit[1] != version_of(plain):
                return None
            self._tensor_names[t] = (hit[0], version_of(t))
        return hit[0]

    def _accumulated_now(self, t: torch.Tensor, version: int) -> str | None:
        """While an accumulator runs, the name of ``t`` if it is the .grad the accumulator has just
        made or added into (``Graph.name_leaf_grad``: named as the accumulator's hook would,
        before a post-accumulate-grad hook that reads it runs); else None."""
        if self.rec.running_node is None:
            return None
        return self.rec.graph.name_leaf_grad(t, version)

    def _indexed_alias(self, t: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """``t``'s storage key, and a named, indexed tensor that ``t`` is the same view of (None:
        none, or the storage is not indexed)."""
        key = storage_key(t)
        return key, self._same_view_alias(t, key) if key and key in self._aliases else None

    def fresh_storage(self, start: int, end: int) -> None:
        """A storage was given the memory [start, end) inside the block (resized from nothing):
        until a recorded call writes into it, a tensor there seen for the first time, or seen
        changed, is recorded as uninitialised memory, not hashed (its bytes are whatever the
        allocator left: two runs of the same program would differ there)."""
        self._fresh = [span for span in self._fresh if span[1] <= start or span[0] >= end]  # (reused)
        self._fresh.append((start, end))

    def _fresh_note(self, t: torch.Tensor) -> str | bool:
        """``FRESH_NOTE`` when ``t`` lies in memory a storage was given and nobody wrote since."""
        return bool(self._fresh) and any(self._within(t, span) for span in self._fresh) and FRESH_NOTE

    @staticmethod
    def _within(t: torch.Tensor, span: tuple[int, int]) -> bool:
        try:
            return t.layout == torch.strided and span[0] <= t.data_ptr() < span[1]
        except RuntimeError:  # no data pointer (a freed storage, a wrapper)
            return False

    def name_data_alias(self, source: torch.Tensor, alias: torch.Tensor) -> None:
        """``source.data`` returned ``alias``: a new tensor object on the same bytes, seen the same
        way, with a version counter of its own (a write through it bumps no version of
        ``source``). It takes ``source``'s name, and both are indexed by their storage, so a
        write through either (``p.data.clamp_()`` before the model runs, ``y.data.mul_(2)``) is
        a new version of the value both show. A tensor the trace knows gives its name now; a
        parameter not named yet, when a call first uses ``alias`` (``_name_read_before``: its
        model is looked for then, not for a read that only asks for a dtype). ``.data`` of any
        other tensor leaves it unnamed (and costs nothing) until a call uses it."""
        if self._tensor_names.get(source) is not None or source in self._named:
            self._take_name_of(source, alias)
        elif type(source) is torch.nn.Parameter:
            self._read_before_named[alias] = (source, "data")

    def _take_name_of(self, source: torch.Tensor, alias: torch.Tensor) -> None:
        """``alias`` (``source.data``) takes ``source``'s current name; both indexed by storage."""
        name = self.name_at(source, version_of(source))
        self._tensor_names[alias] = (name, version_of(alias))
        self._index_pair(source, alias)

    def _index_pair(self, source: torch.Tensor, alias: torch.Tensor) -> None:
        """Index ``source`` and ``alias``, a tensor object on its bytes, by their storage: a write
        through either is a new version of what the other shows."""
        key = storage_key(source)
        if not key:
            return
        refs = self._aliases.setdefault(key, [])
        if len(refs) > 8:  # (a loop of ``p.data.add_()`` leaves one dead alias per turn)
            refs[:] = [r for r in refs if r() is not None]
        if not any(r() is source for r in refs):
            refs.append(weakref.ref(source))
        refs.append(weakref.ref(alias))

    def name_grad_alias(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``param.grad`` returned ``grad``, a tensor the trace has not named: the gradient left
        from before the block (a block that starts after a backward pass: clipping, a
        hand-written update, a step that ends at each backward). A parameter's is named
        ``<param>@grad``, as the backward would have named it: now when the parameter has its
        name, else when a call first uses the gradient (``_name_read_before``: its model is
        looked for then; ``zero_grad()`` at the top of a block reads every ``.grad`` and uses
        none). Not during a backward run: there the accumulators' hooks name what ``.grad``
        becomes (a post-accumulate hook reads it before they run)."""
        if grad in self._named or type(param) is not torch.nn.Parameter or self.rec.in_backward:
            return
        named = self._named.get(param)
        if named is None:
            self._read_before_named[grad] = (param, "grad")
        elif named[1] == "param":
            self._named[grad] = (f"{named[0]}@grad", "grad")

    def name_assigned_grad(self, pname: str, g: torch.Tensor, hit: tuple[str, int]) -> None:
        """``g``, the ``.grad`` of the parameter named ``pname``, is a value the trace named
        otherwise (``hit``): one the program assigned (``p.grad = torch.stack(grads).mean(0)``,
        as parameter-server and hand-made all-reduce loops do). It is also recorded as
        ``<pname>@grad`` (a later one ``@grad@v<k>``), with that value's checksum, and goes by
        that name from now on."""
        if hit[0].startswith(f"{pname}@grad"):
            return
        base = f"{pname}@grad"
        shown = self._trace.tensors.get(hit[0])
        name = self.new_tensor(g, self.bump(base) if base in self._trace.tensors else base, "grad",
                                shown.producer if shown is not None else None, same_as=shown)
        self._named[g] = (name, "grad")

    def _name_read_before(self, t: torch.Tensor, owner: torch.Tensor, how: str) -> bool:
        """Name ``t``, read as ``owner.data`` or ``owner.grad`` before ``owner`` (a parameter)
        had a name, now that a call uses it: ``owner``'s model named first if need be. Whether
        ``t`` has a name to take now."""
        if owner not in self._named and self._tensor_names.get(owner) is None:
            self.name_model_of(owner)
        if how == "data":  # (a parameter no module holds: the alias shares its input<k> name)
            self._take_name_of(owner, t)
            return True
        named = self._named.get(owner)
        if named is None or named[1] != "param":
            return False
        self._named[t] = (f"{named[0]}@grad", "grad")
        return True

    def name_model_of(self, p: torch.Tensor) -> bool:
        """A parameter met before any module of its model ran in the block (outside any module
        call): name that model's modules, parameters and buffers now, as if it had been called
        first (tracer.record.owners). Whether ``p`` has a name to take now."""
        if constructing_a_module():
            return False
        running = self.rec.scopes.innermost()
        if running is not None:  # used by a module running now: the one that holds it, if any
            module = self.rec.scopes.module_at(running)
            if module is not None and self._name_replaced(module, running, p):
                return True
            # Not its own: another model's, reached by the walk over the graph (a GAN's generator,
            # whose forward ran in the step before, met from the discriminator's output).
        search = needs_search(p) and self._owner_searches < MAX_OWNER_SEARCHES
        if search:
            self._owner_searches += 1
        root = owning_root_module(p, search)
        if root is None:
            return False
        root_path = self.rec.scopes.path_of(root)
        if root_path is not None:
            return self._name_replaced(root, root_path, p)
        # A second model (an EMA updated after the trained model's step) under the name the
        # user's code holds it by.
        self.rec.scopes.register_root_module(root, name_in_callers(root, 1) if "" in self._trace.modules else None)
        return p in self._named

    def name_step_inputs(self, optimizer: Any) -> None:
        """An optimizer step begins: its parameters, their gradients and their state get names
        (a parameter met first here: its model is named; a ``.grad`` no backward of the block
        made; state that is not named yet: ``<param>.<key>``)."""
        with self.rec.lock, torch._C.DisableTorchFunction():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    named = self._named.get(p)
                    if named is None:  # a step before any module of its model ran in the block
                        if p in self._tensor_names or not self.name_model_of(p):
                            continue
                        named = self._named.get(p)
                        assert named is not None  # (what _name_model_of says)
                    pname = named[0]
                    g = p.grad
                    if g is not None:
                        hit = self._tensor_names.get(g)
                        if hit is None:
                            # A .grad no backward of the block made (set by hand, or before the block).
                            base = f"{pname}@grad"
                            self.new_leaf_grad(g, self.bump(base) if base in self._trace.tensors else base,
                                                None, None)
                        elif hit[1] != version_of(g):
                            self.name_of(g)  # changed in place since it was named: a new version
                        else:
                            self.name_assigned_grad(pname, g, hit)
                    for key, v in optimizer.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor) and v not in self._named:
                            self._named[v] = (f"{pname}.{key}", "state")

    def names_at(self, ts: list[torch.Tensor], versions: list[int]) -> list[str]:
        """The names of many tensors whose versions the caller has just read, their new values
        handed to the hasher together (an optimizer step's parameters and state)."""
        with self.submits_batched():
            return [self.name_at(t, v) for t, v in zip(ts, versions)]

    def name_new_state(self, optimizer: Any, producer: str | None, record: bool) -> list[torch.Tensor]:
        """After an optimizer step: state it made (its first step) is named after its parameter,
        ``<param>.<key>``; ``record``: also recorded, made by ``producer``. Returns what was
        recorded."""
        created: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                named = self._named.get(p)
                hit = self._tensor_names.get(p) if named is None else None
                owner = named[0] if named is not None else names.base_name(hit[0]) if hit is not None else None
                for key, v in optimizer.state.get(p, {}).items():
                    # State made by this step (the first one): named after its parameter.
                    if owner is not None and isinstance(v, torch.Tensor) and v not in self._named \
                            and self._tensor_names.get(v) is None:
                        self._named[v] = (f"{owner}.{key}", "state")
                        if record:
                            self.new_tensor(v, f"{owner}.{key}", "state", producer)
                            created.append(v)
        return created

    def name_by_paths(self, params: list[tuple[str, torch.Tensor]], buffers: list[tuple[str, torch.Tensor]]) -> None:
        """A root module's parameters and buffers, by path (``named_parameters()``'s order and
        first-wins naming of shared ones): each takes its path for a name."""
        named = self._named
        renamed: list[tuple[torch.Tensor, str, Role]] = []
        for pname, p in params:
            if p not in named:
                named[p] = (pname, "param")
                renamed.append((p, pname, "param"))
        for bname, b in buffers:
            if b not in named:
                named[b] = (bname, "buffer")
                renamed.append((b, bname, "buffer"))
        self._take_paths(renamed)
        self._read_state_ahead(renamed)

    def _read_state_ahead(self, tensors: list[tuple[torch.Tensor, str, Role]]) -> None:
        """Read a root module's parameters and buffers now, in one go, where the values are read
        at all and the batched device path reads them (``Hasher.read_ahead``): each record made
        when a call first uses one (``name_at``) takes what was read, if the tensor is still at
        the version read, instead of being queued itself. A queued value that a call writes in
        place before its batch launches costs a snapshot copy, and a model's state is written so
        (a batch norm writes its running statistics in the call that first reads them: 159
        snapshots a ResNet-50 step; the optimizer step writes every parameter). Writes that bump
        no version counter (a kernel outside torch's) between the root's first call and a value's
        first use are not seen, as they are not anywhere else."""
        rec = self.rec
        if not READ_STATE_AHEAD or not self.reads_values or rec.hasher is not rec.own_hasher:
            return
        known = self._tensor_names
        # (the record the reads go to: its name and role alone, for messages)
        items = [(TensorRecord(path, (), "", "", role), t) for t, path, role in tensors if t not in known]
        if not items:  # (each met before its module ran has a record already: _take_paths)
            return
        with torch._C.DisableTorchFunction():
            ahead = self._read_ahead
            # Nothing runs between the reads being queued and the versions read here.
            for placeholder, t in rec.hasher.read_ahead(items):
                ahead[t] = (version_of(t), placeholder)
                self._reading_ahead = True

    def _take_paths(self, tensors: list[tuple[torch.Tensor, str, Role]]) -> None:
        """Parameters and buffers the trace met before their module ran (made and initialised in
        the block, by the model's own constructor: ``input4``, ``zeros0:out``) take their paths
        now: a record of that name holding the value they hold (its checksum copied),
        ``previous`` the name they had."""
        known = self._tensor_names
        with self.rec.lock, torch._C.DisableTorchFunction():
            for t, path, role in tensors:
                hit = known.get(t)
                if hit is None:
                    continue
                rec = self._trace.tensors.get(hit[0])
                if rec is None or rec.role in ("param", "buffer"):
                    continue
                same = rec if hit[1] == version_of(t) and not rec.uninitialized else None
                self.new_tensor(t, path, role, rec.producer, previous=hit[0], same_as=same)

    def _name_replaced(self, module: torch.nn.Module, prefix: str, p: torch.Tensor) -> bool:
        """A parameter of a model the trace has named already, not named itself: a new Parameter
        object put in place of the one named (``module.to_empty()`` after a meta-device build,
        a move between devices, ``module.weight = nn.Parameter(...)``). It is a new version of
        the path's value (``0.weight@v1``, ``previous`` the path's last version) when the path
        has a record, else the path itself."""
        if swaps_parameters(self.rec.scopes.modules()):
            # FSDP2 puts the unsharded parameter in place of the sharded one for each forward
            # and backward: another form of the same value (named by the all-gather that makes
            # it), not a new one.
            return False
        path = parameter_path(module, prefix, p)
        if path is None:
            return False
        self._named[p] = (path, "param")  # (its gradients: <path>@grad)
        key, shown = self._indexed_alias(p)
        if shown is not None and version_of(shown) == version_of(p):
            hit = self._tensor_names.get(shown)
            if hit is not None and names.base_name(hit[0]) == path:
                # The same bytes, unchanged, as the tensor the path's name is on: a detached alias
                # the module held meanwhile (``functional_call`` with ``{k: v.detach()}``, taken
                # before the block). The parameter shows that value; it is no new one.
                self._tensor_names[p] = (hit[0], version_of(p))
                self.index_alias(p, key)
                return True
        if path in self._trace.tensors:
            last = self._versions.get(path, 0)
            previous = names.version_name(path, last) if last else path
            self.new_tensor(p, self.bump(path), "param", None, previous=previous)
        else:
            self.new_tensor(p, path, "param", None)
        self.index_alias(p)
        return True

    # ---- aliases: tensors that share a named tensor's storage -----------------------------------
    # ``p.data``, ``p.detach()`` and views share p's bytes; ``.data`` does not even share its
    # version counter. Tensors from outside the block (parameters, buffers, optimizer state,
    # inputs, leaves' gradients) are indexed by storage, so that a write through an alias makes a
    # new version of the tensor it aliases. Outputs of calls are not indexed (thousands per step);
    # a write into one through a view still shows as a new version of its base.
    def index_alias(self, t: torch.Tensor, key: int | None = None) -> None:
        """Index ``t`` by its storage (``key``: that storage's, when the caller has read it)."""
        if key is None:
            key = storage_key(t)
        if key:
            self._aliases.setdefault(key, []).append(weakref.ref(t))

    def _same_view_alias(self, t: torch.Tensor, key: int) -> torch.Tensor | None:
        """A named, indexed tensor that ``t`` (whose storage is ``key``) is the same view of
        (``p.data``), if any."""
        for ref in self._aliases.get(key, ()) if key else ():
            o = ref()
            if o is not None and o is not t and same_view(o, t) and storage_key(o) == key \
                    and self._tensor_names.get(o) is not None:
                return o
        return None

    def _alias_name(self, t: torch.Tensor, version: int) -> str | None:
        """The name of an indexed tensor that ``t`` is the same view of (``p.data``), if any."""
        key = indexed_storage_key(t, self._aliases)
        o = self._same_view_alias(t, key)
        if o is None:
            return None
        name = self.name_at(o, version_of(o))  # a new version first, if o changed unseen
        self._tensor_names[t] = (name, version)
        self._aliases[key].append(weakref.ref(t))
        return name

    def write_through_aliases(self, mutated: list[torch.Tensor], names_of: dict[int, str], call: str,
                              ins: list[torch.Tensor], api: str = "", wrote_out: bool = False) -> list[str]:
        """A call that changed ``mutated`` changed every named tensor sharing their bytes too. Its
        own inputs excepted: an op keeps what it reads (an in-place all-gather's input is a slice
        of its output, rewritten with the same bytes). Returns the names of the new versions it
        made that way (a view's base, a parameter written through a detached alias): what the
        call wrote without being handed it."""
        made: list[str] = []
        done = set(names_of)
        done.update(identity(t) for t in ins)
        aliases = self._aliases
        for t in mutated:
            new = names_of[identity(t)]
            others: list[torch.Tensor] = []
            refs = aliases.get(storage_id(t)) if aliases else None
            if refs:
                # The tensor itself first, without reading any storage: an optimizer step writes
                # hundreds of indexed tensors, each usually its storage's only one, and then
                # nothing more is read. Else the storage is checked to be one that holds memory
                # (storage_key) and each other tensor to be on it still (an entry whose storage
                # has changed since, by set_ or resize, is not an alias).
                for ref in refs:
                    o = ref()
                    if o is not None and o is not t and identity(o) not in done:
                        others.append(o)
                key = storage_key(t) if others else 0
                others = [o for o in others if storage_key(o) == key] if key else []
            base = t._base
            if base is not None:
                others.append(base)
            for o in others:
                k = identity(o)
                if k in done:
                    continue
                hit = self._tensor_names.get(o)
                if hit is None:
                    continue
                done.add(k)
                if same_view(o, t):  # the same bytes seen through another tensor object
                    old = self._trace.tensors.get(hit[0])
                    own = names.base_name(hit[0])
                    if old is not None and names.base_name(new) != own:
                        # Written through a detached alias of its own name: a parameter, buffer or
                        # optimizer state (an EMA's foreach update of ``p.detach()`` lists,
                        # AveragedModel's first copy), or a call's output (``y.detach().zero_()``).
                        # Its own next version, made by the call, with the written value's
                        # checksum: else its name would stay on the value before the write.
                        made.append(self.new_tensor(o, self.bump(own), old.role, call, previous=hit[0],
                                                    same_as=self._trace.tensors.get(new)))
                    else:
                        self._tensor_names[o] = (new, version_of(o))
                else:
                    old = self._trace.tensors.get(hit[0])
                    role = old.role if old is not None else "input"
                    # (a view's write into uninitialised memory: the rest of it stays so, unless
                    # the call's views of it cover it whole)
                    uninit = old is not None and old.uninitialized and self._still_uninitialised(
                        api, call, wrote_out, sum(m.numel() for m in mutated if m._base is o), old.numel)
                    made.append(self.new_tensor(o, self.bump(names.base_name(hit[0])), role, call, previous=hit[0],
                                                uninitialized=uninit))
        return made

    def bump(self, base: str) -> str:
        n = self._versions.get(base, 0) + 1
        self._versions[base] = n
        return names.version_name(base, n)
