"""Distributed training: rank metadata, one file per rank, collectives recorded as calls.

``tracer.record.session`` calls into this module when a ``torch.distributed`` process group is
initialized: ``rank_info()`` for the trace header (``launched_rank_info()`` when torchrun started
the process but the group does not exist yet), ``rank_path()`` for the per-rank file name, and
``attach(recorder)`` once the recorder is installed; the function ``attach`` returns removes
everything it installed. ``collective_for(recorder, func)`` lets the recorder's mode hand over
collectives it sees that the wrappers missed (references taken before the trace).

What ``attach`` installs and why:

- Wrappers around the ``torch.distributed`` collectives (``all_reduce``, ``all_gather``...,
  ``barrier``, ``send``/``recv``), patched in both ``torch.distributed`` and
  ``torch.distributed.distributed_c10d`` (the same function objects live in both; library code
  such as FSDP2 calls them through the module attribute). The recorder's TorchFunctionMode sees
  most of them too, but it cannot record them: c10d ops change their tensors in place without
  bumping the version counter, so the generic path sees "no output, nothing changed" and drops
  the call. Each wrapper records one call of kind ``collective`` whose outputs are the tensors
  the collective writes (an ``all_reduce``'s tensor becomes ``<name>@v1``, produced by the
  call), hashed after the collective ran. ``args`` says the group first (``group=[0, 1]``),
  then the reduce op, src/dst and ``async_op``.
- Wrappers around the functional collectives (``torch.distributed._functional_collectives``):
  their results are ``AsyncCollectiveTensor``s whose data arrive later, so while tracing the
  wrapper waits for them at once (so the checksum is of the result, not of memory still being
  written) and returns the plain tensor.
- A listener that records DDP's bucketed gradient all-reduce. That all-reduce runs in DDP's C++
  reducer, unseen by Python; a comm hook would see the buckets, but a comm hook can never be
  removed (and a second one cannot be registered), so a trace would change the user's model
  for good. Instead, at the end of every backward run that DDP synchronised, one call
  ``ddp_allreduce<k>`` is recorded per DDP module: its inputs are the local gradients
  (``<param>@grad``), its outputs the averaged gradients now on the parameters
  (``<param>@grad@v1`` when DDP wrote into the same tensor, ``<param>.grad`` when the
  parameter holds another tensor), and ``args`` gives
  the bucket count and sizes and the backward run it happened in (the call itself is recorded
  when that run returns, on the user's thread, so its phase is ``forward``).
  With ``gradient_as_bucket_view`` each ``.grad`` is a view into a bucket that the reducer
  divides and all-reduces in place as soon as the accumulator has added into it, before
  gradtrace's hook on the accumulator runs, and the all-reduce moves no version counter. So the
  accumulated value (``<param>@grad@v<n>``) is named and read in a post-accumulate-grad hook on
  each parameter, which runs inside the accumulator, and every gradient is a new version in
  ``ddp_allreduce<k>``'s outputs.

Async collectives (``async_op=True``, ``isend``/``irecv``, ``batch_isend_irecv``) are recorded
when issued: inputs are hashed, the tensors they will write get their new name at once but are
not hashed (their data arrive after ``wait()``, which the tracer never calls for the user). One
issued by a DDP comm hook in the backward first has every waiting value read: the hook's future
writes the bucket where the trace cannot see it.

Collectives are recorded on the thread that owns the trace, and on autograd engine threads while
a traced backward runs (DDP/FSDP hooks on CUDA); on other threads they pass through untouched.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules import module as nn_module
from torch.nn.parallel import DistributedDataParallel

try:  # absent from torch builds without distributed support
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
except ImportError:
    c10d = None  # type: ignore[assignment]
    funcol = None  # type: ignore[assignment]
    AsyncCollectiveTensor = None  # type: ignore[assignment,misc]

from tracer.model import BackwardRun, Call, Trace, names
from tracer.record import naming
from tracer.record.listeners import Listener
from tracer.record.mode import on_traced_thread
from tracer.record.protocol import RecorderAPI
from tracer.record.tensors import flat_tensors
from tracer.record.weakmap import IdWeakMap

# ---- which collectives, and which of their arguments they write ----------------------------------


@dataclass(frozen=True)
class _Spec:
    writes: tuple[str, ...] = ()  # parameters whose tensors the collective writes
    always_async: bool = False  # returns a Work whatever async_op says (isend, irecv)


# torch.distributed functions, by name. Names missing from a torch version are skipped.
C10D: dict[str, _Spec] = {
    "all_reduce": _Spec(("tensor",)),
    "all_reduce_coalesced": _Spec(("tensors",)),
    "broadcast": _Spec(("tensor",)),
    "all_gather": _Spec(("tensor_list",)),
    "all_gather_coalesced": _Spec(("output_tensor_lists",)),
    "all_gather_into_tensor": _Spec(("output_tensor",)),
    "all_gather_single": _Spec(("output_tensor",)),
    "_all_gather_base": _Spec(("output_tensor",)),
    "reduce_scatter": _Spec(("output",)),
    "reduce_scatter_tensor": _Spec(("output",)),
    "reduce_scatter_single": _Spec(("output",)),
    "_reduce_scatter_base": _Spec(("output",)),
    "all_to_all": _Spec(("output_tensor_list",)),
    "all_to_all_single": _Spec(("output",)),
    "reduce": _Spec(("tensor",)),
    "gather": _Spec(("gather_list",)),
    "scatter": _Spec(("tensor",)),
    "send": _Spec(()),
    "recv": _Spec(("tensor",)),
    "isend": _Spec((), always_async=True),
    "irecv": _Spec(("tensor",), always_async=True),
    "batch_isend_irecv": _Spec(("p2p_op_list",), always_async=True),
    "barrier": _Spec(()),
    "monitored_barrier": _Spec(()),
}
# Functional collectives: they return new tensors (AsyncCollectiveTensor until waited for).
# DTensor redistributes through the ``*_single`` forms (torch 2.13: Shard -> Replicate is
# ``all_gather_single``, Partial -> Shard ``reduce_scatter_single``); the ``*_autograd`` forms
# serve loss_parallel and sequence parallelism.
FUNCOL = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_into_tensor_coalesced",
          "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast",
          "permute_tensor", "all_gather_single", "reduce_scatter_single", "all_gather_single_coalesced",
          "reduce_scatter_single_coalesced", "all_gather_tensor_autograd", "all_gather_single_autograd",
          "reduce_scatter_tensor_autograd", "reduce_scatter_single_autograd", "all_to_all_single_autograd")
_FUNCOL_MODULE = "torch.distributed._functional_collectives"
# The ops underneath (torch.ops._c10d_functional.*), for calls the mode sees (see collective_for).
FUNCOL_OPS = frozenset({"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor",
                        "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
                        "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast"})
DDP_CALL = "ddp_allreduce"
DDP_API = "torch.nn.parallel.DistributedDataParallel.reducer.allreduce"
ASYNC_NOTE = ("async collectives (async_op=True, isend/irecv) are recorded when issued: their inputs are hashed, "
              "the tensors they write are named but not hashed (their data arrive after wait())")
FUNCOL_NOTE = ("functional collectives were waited for as soon as they were issued (so their results could be "
               "hashed) and returned as plain tensors instead of AsyncCollectiveTensor")
DDP_NOTE = ("DDP's gradient all-reduce is recorded once per synchronised backward run and DDP module "
            f"({DDP_CALL}<k>): per-parameter checksums of the averaged gradients; the bucket buffers "
            "themselves are not reachable without a comm hook")


# ---- header and file names ------------------------------------------------------------------------
def rank_info() -> dict[str, Any]:
    """Where this process runs: rank, world size, backend, local rank and the group layout."""

    rank, world = dist.get_rank(), dist.get_world_size()
    info: dict[str, Any] = {"rank": rank, "world_size": world, "backend": str(dist.get_backend())}
    for key, env in (("local_rank", "LOCAL_RANK"), ("local_world_size", "LOCAL_WORLD_SIZE"),
                     ("node_rank", "GROUP_RANK")):
        value = os.environ.get(env)
        info[key] = int(value) if value is not None and value.lstrip("-").isdigit() else None
    info["launcher"] = "torchelastic" if dist.is_torchelastic_launched() else None
    groups: list[dict[str, Any]] = []
    try:  # c10d's group registry is private: a torch that moved it costs the layout, not the trace
        registry = list(c10d._world.pg_group_ranks.items())
        names = c10d._world.pg_names
    except AttributeError:
        registry, names = [], {}
    for pg, members in registry:
        if not isinstance(pg, dist.ProcessGroup):  # groups this rank is not part of
            continue
        try:
            backend = str(dist.get_backend(pg))
        except Exception:  # a group whose backend cannot be named
            backend = None
        ranks = [g for g, _ in sorted(members.items(), key=lambda kv: kv[1])]
        groups.append({"name": names.get(pg, ""), "ranks": ranks, "backend": backend})
    groups.sort(key=lambda g: (len(g["name"]), g["name"]))
    info["default_group"] = list(range(world))
    info["groups"] = groups
    info["initialized"] = True
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        info["device"] = f"cuda:{torch.cuda.current_device()}"
    return info


def launched_rank_info() -> dict[str, Any] | None:
    """Rank and world size from the launcher's environment (torchrun sets ``RANK`` and
    ``WORLD_SIZE``) for a trace that begins before ``init_process_group`` (``gradtrace run``
    under torchrun traces from the program's start); None when not launched that way."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None or not rank.isdigit() or not world.isdigit():
        return None
    info: dict[str, Any] = {"rank": int(rank), "world_size": int(world), "backend": None}
    for key, env in (("local_rank", "LOCAL_RANK"), ("local_world_size", "LOCAL_WORLD_SIZE"),
                     ("node_rank", "GROUP_RANK")):
        value = os.environ.get(env)
        info[key] = int(value) if value is not None and value.isdigit() else None
    info["launcher"] = "torchelastic" if os.environ.get("TORCHELASTIC_RUN_ID") else "env"
    info["default_group"] = list(range(int(world)))
    info["groups"] = []
    info["initialized"] = False  # the process group did not exist yet when the trace began
    return info


_RANK_IN_NAME = re.compile(r"\.rank\d+(?=\.|$)")


def rank_path(out: str, rank: int) -> str:
    """``step.gtrace`` -> ``step.rank0.gtrace``; ``x.gtrace.gz`` -> ``x.rank0.gtrace.gz``.

    A ``{rank}`` in the path is filled in instead; a path that already names a rank
    (``step.rank1.gtrace``) is kept as it is.
    """
    if "{rank}" in out:
        return out.replace("{rank}", str(rank))
    head, base = os.path.split(out)
    if _RANK_IN_NAME.search(base):
        return out
    for ext in (".gtrace.gz", ".gtrace", ".jsonl.gz", ".jsonl", ".json.gz", ".json", ".gz"):
        if base.endswith(ext) and len(base) > len(ext):
            return os.path.join(head, f"{base[:-len(ext)]}.rank{rank}{ext}")
    stem, ext = os.path.splitext(base)
    return os.path.join(head, f"{stem or base}.rank{rank}{ext if stem else ''}")


# ---- describing arguments -------------------------------------------------------------------------
def _ranks_of(group: Any) -> list[int] | None:
    """The global ranks of a group argument (None = the default group), or None if unknown."""

    try:
        if group is None:
            return list(range(dist.get_world_size()))
        if isinstance(group, dist.ProcessGroup):
            return list(dist.get_process_group_ranks(group))
        if isinstance(group, list) and all(isinstance(r, int) for r in group):
            return list(group)
        name = funcol._resolve_group_name(group, "")
        pg = torch._C._distributed_c10d._resolve_process_group(name)
        return list(dist.get_process_group_ranks(pg))
    except Exception:  # a group form this torch does not resolve: say so, don't fail the step
        return None


def _group_text(group: Any) -> Any:
    ranks = _ranks_of(group)
    if ranks is None:
        return "?"
    if len(ranks) <= 8:
        return ranks
    try:  # a long list would be cut in the args text: name the group (its ranks are in the header)

        pg = group if isinstance(group, dist.ProcessGroup) else dist.group.WORLD if group is None else None
        if pg is not None:
            return f"{pg.group_name} ({len(ranks)} ranks)"
    except Exception:
        pass
    return f"{ranks[:4]}… ({len(ranks)} ranks)"


def _op_text(op: Any) -> str:
    name = getattr(op, "name", None)
    if isinstance(name, str):
        return name
    text = str(op)
    return text.rsplit(".", 1)[-1]


def _describe_args(bound: inspect.BoundArguments) -> dict[str, Any]:
    """The non-tensor arguments worth showing, group first (args text is cut at 120 chars)."""
    bound.apply_defaults()  # the reduce op is worth showing even when left at SUM
    a = bound.arguments
    out: dict[str, Any] = {"group": _group_text(a.get("group"))}
    for key in ("op", "reduceOp"):
        if key in a:
            out["op"] = _op_text(a[key])
    for key in ("src", "dst", "group_src", "group_dst", "gather_dim", "scatter_dim", "tag"):
        if a.get(key) is not None and not (key == "tag" and a[key] in (0, "")):
            out[key] = a[key]
    if a.get("async_op"):
        out["async_op"] = True
    return out


def _flat(obj: Any) -> list[torch.Tensor]:

    if type(obj).__name__ == "P2POp":
        return [obj.tensor]
    if isinstance(obj, list | tuple) and obj and type(obj[0]).__name__ == "P2POp":
        return [p.tensor for p in obj]
    return flat_tensors(obj)


def _p2p_writes(ops: Any) -> list[torch.Tensor]:
    """The tensors a ``batch_isend_irecv`` list writes: those of its receives."""
    return [p.tensor for p in ops if getattr(p.op, "__name__", "") == "irecv"]


def _unique(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in ts:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


# ---- recording -------------------------------------------------------------------------------------
_local = threading.local()


@contextlib.contextmanager
def _inside() -> Iterator[None]:
    """Marks this thread as running a recorded collective: collectives it calls pass through."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _should_record(rec: RecorderAPI) -> bool:
    if rec.closed or rec.stopped or rec.paused or getattr(_local, "depth", 0) > 0:
        return False
    # DDP/FSDP hooks issue collectives from autograd engine threads during a traced backward.
    return on_traced_thread(rec)


def _add_note(trace: Trace, note: str) -> None:
    if note not in trace.notes:
        trace.notes.append(note)


class _Attachment:
    """Everything ``attach`` installed for one recorder; ``detach`` removes it all."""

    def __init__(self, rec: RecorderAPI) -> None:
        self.ref = weakref.ref(rec)
        self.patches: list[tuple[Any, str, Any]] = []  # (module, attribute, original)
        self.by_original: dict[Any, Any] = {}  # original function -> its recording wrapper
        self.pending: weakref.WeakSet[Any] = weakref.WeakSet()  # DDP modules whose backward will sync
        self.listener = _DDPListener(self)
        self.hook: Any = None
        # Post-accumulate-grad hooks on the parameters of DDP modules with bucket views (see
        # _read_before_reducer), one per parameter, removed with the rest.
        self.grad_hooks: list[Any] = []
        # (by identity: a WeakSet compares tensors with ==, elementwise)
        self.hooked: IdWeakMap[bool] = IdWeakMap()

    # -- installation
    def install(self) -> None:
        wrappers: dict[int, Any] = {}
        for mod in (dist, c10d):
            for name, spec in C10D.items():
                original = getattr(mod, name, None)
                if original is None or not callable(original):
                    continue
                if id(original) not in wrappers:
                    wrappers[id(original)] = self._c10d_wrapper(name, original, spec)
                    self.by_original[original] = wrappers[id(original)]
                self._patch(mod, name, wrappers[id(original)])
        if funcol is not None:
            for name in FUNCOL:
                original = getattr(funcol, name, None)
                if original is not None:
                    self.by_original[original] = self._funcol_wrapper(name, original)
                    self._patch(funcol, name, self.by_original[original])
        rec = self.ref()
        assert rec is not None
        rec.listeners.append(self.listener)
        self.hook = nn_module.register_module_forward_pre_hook(self._module_pre)

    def _patch(self, mod: Any, name: str, wrapper: Any) -> None:
        self.patches.append((mod, name, getattr(mod, name)))
        setattr(mod, name, wrapper)

    def detach(self) -> None:
        rec = self.ref()
        if rec is not None:
            _ATTACHED.pop(rec, None)
            rec.collective_hook = None
        self.by_original.clear()
        while self.patches:
            mod, name, original = self.patches.pop()
            setattr(mod, name, original)
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        while self.grad_hooks:
            self.grad_hooks.pop().remove()
        if rec is not None and self.listener in rec.listeners:
            rec.listeners.remove(self.listener)

    # -- torch.distributed functions
    def _c10d_wrapper(self, name: str, original: Any, spec: _Spec) -> Any:
        sig = inspect.signature(original)
        api = f"torch.distributed.{name}"
        short = name.lstrip("_")

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = self.ref()
            if rec is None or not _should_record(rec):
                return original(*args, **kwargs)
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:  # let the function itself report the bad call
                return original(*args, **kwargs)
            a = bound.arguments
            ins = _unique([t for v in a.values() for t in _flat(v)])
            if name == "batch_isend_irecv":
                writes = _unique(_p2p_writes(a.get("p2p_op_list") or []))
            else:
                writes = _unique([t for p in spec.writes for t in _flat(a.get(p))])
            is_async = spec.always_async or bool(a.get("async_op"))
            described = _describe_args(bound)
            if spec.always_async:
                described["async_op"] = True
            if is_async and rec.in_backward and self._comm_hook_syncs():
                # Issued by a DDP comm hook: its future's callbacks, which run on another thread
                # (gloo) or behind the collective's stream (NCCL) where the trace cannot see them,
                # write the bucket in place (fp16_compress_hook decompresses into it). Every value
                # still waiting for its checksum is read now, before the collective is issued: a
                # read on the current stream is ordered before the collective and so before them.
                return self._run(rec, original, args, kwargs, api, short, described, ins, writes, is_async, None,
                                 read_all_first=True)
            return self._run(rec, original, args, kwargs, api, short, described, ins, writes, is_async, None)

        return wrapper

    def _funcol_wrapper(self, name: str, original: Any) -> Any:
        sig = inspect.signature(original)
        api = f"{_FUNCOL_MODULE}.{name}"

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = self.ref()
            # Inside another recorded op (a DTensor op redistributing) the collective is that
            # op's implementation: leave it and its AsyncCollectiveTensor alone.
            if rec is None or rec.op_depth or not _should_record(rec):
                return original(*args, **kwargs)
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)
            ins = _unique([t for v in bound.arguments.values() for t in _flat(v)])
            return self._run(rec, original, args, kwargs, api, name, _describe_args(bound), ins, [], False, _wait)

        return wrapper

    def _run(self, rec: RecorderAPI, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any], api: str,
             short: str, described: dict[str, Any], ins: list[torch.Tensor], writes: list[torch.Tensor],
             is_async: bool, waiter: Callable[[Any], Any] | None, read_all_first: bool = False) -> Any:
        """Name the inputs, run the collective (waited for by ``waiter`` for functional ones, whose
        results are their outputs), and record the call. ``read_all_first``: every value waiting
        for its checksum is read before the collective runs, not only those it writes."""
        functional = waiter is not None
        try:
            # What it writes (its outputs, for c10d's in-place collectives) is read first.
            pending = rec.begin_call(ins, api=api, short=short, kind="collective",
                                     may_write=True if read_all_first else writes)
        except Exception:  # never let the trace break the collective
            return original(*args, **kwargs)
        # The mode is off while the collective runs: it would see the same function (c10d
        # functions dispatch __torch_function__) or the functional ops inside, a second time.
        with _inside(), torch._C.DisableTorchFunction():
            try:
                result = original(*args, **kwargs)
                if waiter is not None:
                    result = waiter(result)
            except BaseException as exc:
                with contextlib.suppress(Exception):  # the user's exception is the one to see
                    rec.fail_call(pending, exc, kwargs=described)
                raise
        # What a collective writes is its output (c10d functions return None or a Work).
        outs = _unique(_flat(result)) if functional else writes
        if is_async:
            _add_note(rec.trace, ASYNC_NOTE)
        if functional:
            _add_note(rec.trace, FUNCOL_NOTE)
        unhashed = rec.unhashed("not hashed: async collective, result not ready when issued") if is_async \
            else contextlib.nullcontext()
        try:
            with unhashed:
                rec.finish_call(pending, outs, writes, kwargs=described)
        except Exception as exc:  # the collective ran: the step goes on, the trace says what it missed
            _add_note(rec.trace, f"gradtrace could not record a call of {api}: {type(exc).__name__}: {exc}")
        return result

    def funcol_op_wrapper(self, op: Any, name: str) -> Any:
        """A recording wrapper for ``torch.ops._c10d_functional.<name>`` (called by the mode)."""
        api = f"torch.ops._c10d_functional.{name}"
        schema = getattr(op, "_schema", None) or op.default._schema
        arg_names = [a.name for a in schema.arguments]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = self.ref()
            if rec is None or not _should_record(rec):
                return op(*args, **kwargs)
            given = {**dict(zip(arg_names, args)), **kwargs}
            described: dict[str, Any] = {"group": _group_text(given.get("group_name"))}
            if isinstance(given.get("reduce_op"), str):
                described["op"] = given["reduce_op"].upper()
            if given.get("src") is not None:
                described["src"] = given["src"]
            ins = _unique([t for v in given.values() for t in _flat(v)])
            return self._run(rec, op, args, kwargs, api, name, described, ins, [], False, _wait_op)

        return wrapper

    # -- DDP
    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        rec = self.ref()
        if rec is None or rec.closed or threading.get_ident() != rec.owner or rec.in_backward:
            return
        # DDP prepares its reducer (so that the next backward all-reduces) only in this case.
        if isinstance(module, DistributedDataParallel) and torch.is_grad_enabled() \
                and module.require_backward_grad_sync:
            self.pending.add(module)
            if getattr(module, "gradient_as_bucket_view", False):
                self._hook_bucket_view_grads(module)

    def _comm_hook_syncs(self) -> bool:
        """Whether a DDP module with a comm hook synchronises in the backward running now."""
        return any(getattr(ddp, "_comm_hooks", None) for ddp in list(self.pending))

    def _hook_bucket_view_grads(self, ddp: Any) -> None:
        """With ``gradient_as_bucket_view`` each .grad is a view into a bucket that DDP's reducer
        divides and all-reduces in place right after the accumulator adds into it, in its own
        hook on the accumulator, which runs before gradtrace's; the all-reduce moves no version
        counter and may still be writing (NCCL: on its own stream) when gradtrace's hook reads.
        A post-accumulate-grad hook runs inside the accumulator, before any hook on it: there the
        accumulated value is named and read (``_read_before_reducer``)."""
        for p in ddp.parameters():
            if p.requires_grad and self.hooked.get(p) is None:
                self.hooked[p] = True
                self.grad_hooks.append(p.register_post_accumulate_grad_hook(
                    functools.partial(_read_before_reducer, self.ref)))

    def record_ddp(self, run: BackwardRun) -> None:
        rec = self.ref()
        if rec is None or rec.closed or rec.stopped:
            return
        for ddp in list(self.pending):
            self.pending.discard(ddp)
            try:
                with rec.lock, torch._C.DisableTorchFunction():
                    _record_ddp(rec, ddp, run)
            except Exception as exc:  # never fail the user's backward over a trace record
                _add_note(rec.trace, f"gradtrace could not record DDP's all-reduce: {type(exc).__name__}: {exc}")


class _DDPListener(Listener):
    def __init__(self, attachment: _Attachment) -> None:
        self.attachment = attachment

    def on_backward_end(self, trace: Trace, run: BackwardRun, error: BaseException | None) -> None:
        if error is None:
            self.attachment.record_ddp(run)


def _read_before_reducer(ref: weakref.ref[RecorderAPI], param: torch.Tensor) -> None:
    """A post-accumulate-grad hook of a parameter of a DDP module with bucket views (see
    ``_Attachment._hook_bucket_view_grads``). Never fails the user's backward."""
    rec = ref()
    if rec is None or rec.closed or rec.stopped or not on_traced_thread(rec):
        return
    try:
        with torch._C.DisableTorchFunction():
            rec.leaf_grad_written_unseen(param)
    except Exception as exc:
        _add_note(rec.trace, f"gradtrace could not read a gradient before DDP's all-reduce: {type(exc).__name__}: {exc}")


def _wait(result: Any) -> Any:
    """A functional collective's result(s), waited for and unwrapped to plain tensors."""
    if isinstance(result, list | tuple):
        return type(result)(_wait(r) for r in result)
    return result.wait() if AsyncCollectiveTensor is not None and isinstance(result, AsyncCollectiveTensor) else result


def _wait_op(result: Any) -> Any:
    """The result of a ``_c10d_functional`` op once its data arrived (waiting twice is harmless:
    the AsyncCollectiveTensor the caller wraps it in waits again, for nothing)."""
    wait = torch.ops._c10d_functional.wait_tensor
    if isinstance(result, list | tuple):
        return type(result)(wait(r) for r in result)
    return wait(result)


def _funcol_op_name(func: Any) -> str | None:
    if not isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return None
    parts = str(func).split(".")  # _c10d_functional.all_reduce[.default]
    if len(parts) >= 2 and parts[0] == "_c10d_functional" and parts[1] in FUNCOL_OPS:
        return parts[1]
    return None


def _record_ddp(rec: RecorderAPI, ddp: Any, run: BackwardRun) -> None:
    name = rec.call_name(DDP_CALL)
    params = getattr(ddp, "_module_parameters", None) or [p for p in ddp.parameters() if p.requires_grad]
    ins: list[str] = []
    outs: list[str] = []
    produced: list[torch.Tensor] = []
    run_index = rec.run_index
    # With bucket views the all-reduce writes each .grad in place through the bucket, moving no
    # version counter: every gradient the reducer holds is a new value, whatever its version.
    bucket_views = bool(getattr(ddp, "gradient_as_bucket_view", False))
    for p in params:
        pname = rec.param_name(p)
        g = p.grad
        if pname is None or g is None:
            continue
        if not bucket_views and rec.current_name(g) is not None:
            # Unchanged since the trace named it: DDP wrote nothing here (an unused parameter).
            continue
        prev = rec.known_name(g)
        if prev is not None:  # the local gradient, averaged in place
            out = rec.new_version(g, prev, "grad", name)
        else:  # the parameter holds another tensor (a bucket view): a new version of its gradient
            local = f"{pname}{names.grad_suffix(run_index)}"
            prev = local if local in rec.trace.tensors else None
            out = rec.leaf_grad(g, pname, name, prev)
        if prev is not None:
            ins.append(prev)
        outs.append(out)
        produced.append(g)
    try:
        data = ddp._get_ddp_logging_data()
        sizes = [int(s) for s in str(data.get("bucket_sizes", "")).split(",") if s.strip()]
    except Exception:  # logging data is best effort
        sizes = []
    described: dict[str, Any] = {"group": _group_text(getattr(ddp, "process_group", None)),
                                 "buckets": len(sizes), "bucket_bytes": sizes, "during": run.name}
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        described["comm_hook"] = getattr(hooks[0][0], "__qualname__", "?")
    rec.add_call(Call(
        name=name, api=DDP_API, module=rec.module_path(ddp) or "", inputs=ins, outputs=outs,
        args=naming.short_args((), described), stack_id=rec.capture_stack(), parent=None, kind="collective",
        # Observed on the user's thread as the backward run ends (the engine has run every node): of
        # the backward phase, met after the run's nodes; args name the run it happened in.
        phase=rec.phase_of(name, "collective", ins, produced), seq=rec.next_call_seq()), produced)
    _add_note(rec.trace, DDP_NOTE)


_ATTACHED: weakref.WeakKeyDictionary[Any, _Attachment] = weakref.WeakKeyDictionary()


def attach(recorder: RecorderAPI) -> Callable[[], None]:
    """Install the collective wrappers and the DDP listener for ``recorder``; returns the
    function that removes them all (safe to call twice)."""
    att = _Attachment(recorder)
    try:
        att.install()
    except BaseException:
        att.detach()
        raise
    _ATTACHED[recorder] = att
    recorder.collective_hook = collective_for
    return att.detach


def collective_for(recorder: RecorderAPI, func: Any) -> Callable[..., Any] | None:
    """The recording wrapper of a collective, for the recorder's TorchFunctionMode.

    Code that took a reference before the trace (``from torch.distributed import all_reduce``)
    calls the original function, which the mode then sees (c10d functions dispatch
    ``__torch_function__``) but cannot record (no version bump, no output); the ops under the
    functional collectives (``torch.ops._c10d_functional.all_reduce``...) reach the mode the same
    way, with results still in flight. The mode can hand such a call to the wrapper returned
    here; None for anything else.
    """
    att = _ATTACHED.get(recorder)
    if att is None:
        return None
    try:
        hit = att.by_original.get(func)
    except TypeError:  # an unhashable callable
        return None
    if hit is None:
        name = _funcol_op_name(func)
        if name is not None:
            hit = att.by_original[func] = att.funcol_op_wrapper(func, name)
    return hit


def distributed_info() -> dict[str, Any] | None:
    """Rank, world size, backend and group layout under a process group (or torchrun's
    environment, for a trace that starts before ``init_process_group``); None otherwise."""

    if not dist.is_available():
        return None
    return rank_info() if dist.is_initialized() else launched_rank_info()


class DistributedPlugin:
    """Composes distributed runs into a trace session: the header says where the trace ran, each
    rank writes its own file (``step.rank0.gtrace``), and collectives are recorded."""

    def prepare(self, session: Any, trace: Trace) -> None:
        self.info = distributed_info()
        if self.info is not None:
            trace.header["distributed"] = self.info
            if session.out:
                session.out = rank_path(session.out, self.info["rank"])

    def attach(self, recorder: RecorderAPI) -> Callable[[], None] | None:
        return attach(recorder) if self.info is not None else None
