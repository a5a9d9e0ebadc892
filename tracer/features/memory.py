"""Recording memory: every allocation and free of a traced block, attributed to the call or grad
node that made it (the record is ``tracer.analysis.memory.MemoryRecord``), and the allocator's
state now (``memory_summary``).

    with tracer.record_memory() as rec:          # or tracer.trace(memory=True) / MemoryRecord.from_trace
        loss = model(x).pow(2).mean(); loss.backward()
    print(rec.table()); rec.peak; rec.to_csv("mem.csv"); rec.plot("mem.png")
    print(tracer.memory_summary())                # the allocator's state now (CUDA) / what is known (CPU)

Where the bytes are seen:

- CUDA, ``history``: the caching allocator records every alloc and free itself
  (``torch.cuda.memory._record_memory_history``, private: feature-detected). The listener tags
  each stretch of work with a short string (``torch.cuda.memory._set_memory_metadata``, which the
  allocator keeps per thread and copies into each entry), so each entry names the call or grad
  node that was running. Nothing is synchronised and nothing is read per call.
- CUDA, ``deltas`` (a torch without allocation metadata): the allocator's counters are read at
  every call and grad-node boundary; each interval's allocated and freed bytes become one alloc
  and one free event of the call or node that ran in it. No per-tensor detail.
- CPU: the CPU allocator keeps no record, so the listener follows tensor storages: each storage
  made by a recorded call (or produced by a grad node) is an allocation of ``nbytes``, and its
  death (a weak reference on the storage, which lives exactly as long as its memory) is the free.
  Temporaries inside one op, and storages made by code the trace does not see, are not counted.

Attribution: an event belongs to the call or grad node running on its thread when it happened.
Between two of them it belongs to the one that ran last, with ``after: true`` (a grad node's
saved tensors are released right after it ran; a tensor dropped by the user's code right after a
call). Gradients the engine creates before a node runs (the root gradient, sums of two
contributions) belong to what ran before: ``backward0`` for the root, the producing node for a sum.

Each event is a plain dict stored in ``Trace.memory`` (``{"t": "memory", ...}`` in the file):

    seq              position in the record (all devices merged, by time)
    action           "alloc" | "free"; "start" / "end" markers carry a device's figures
    bytes            size requested (CUDA) or storage bytes (CPU)
    device           "cpu" | "cuda:0" ...
    addr             block address (CUDA) / storage address (CPU); pairs a free with its alloc
    allocated_after  bytes allocated on that device after the event (CPU: live bytes of tracked storages)
    reserved_after   bytes reserved by the caching allocator after the event (None on CPU)
    owner            name of the call, grad node or backward run responsible (None: unknown)
    after            true when it happened after ``owner`` finished, before the next began
    phase            "forward" | "backward"
    tensor           name of the tensor whose storage it is, where known
    source           (markers only) "history" | "deltas" | "storages"
    requested        (markers only, CUDA) the allocator's requested bytes at that point
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
import threading
import time
import weakref
from typing import Any, cast

import torch
from torch.cuda import memory as cm

try:  # POSIX only: peak resident memory
    import resource
except ImportError:
    resource = None  # type: ignore[assignment]

from tracer.analysis.memory import BUCKETS, MemorySummary, bucket_label
from tracer.model import BackwardRun, Call, MemoryEvent, NodeRun, Trace
from tracer.record.listeners import Listener

# Ops that return a new tensor over an existing storage without being a view (no ``_base``).
_ALIAS_APIS = frozenset({"detach", "detach_", "alias", "data", "__get__", "requires_grad_", "set_",
                         "share_memory_", "as_subclass", "_coalesced_", "_make_subclass"})
_BACKWARD_KINDS = frozenset("nmbB")
_listener_ids = itertools.count()

# Tags say what runs on a thread: (kind, index). c/a: a call is running / ran last (index: the
# listener's token for it); n/m: a grad node (index into ``_nodes``); b/B: a backward run.
Tag = tuple[str, int]


def _cuda_history_api() -> bool:
    c = torch._C
    return hasattr(c, "_cuda_setMemoryMetadata") and hasattr(c, "_cuda_record_memory_history") \
        and hasattr(c, "_cuda_memorySnapshot")


_VIEW_APIS: dict[str, bool] = {"__get__": True}  # short API name -> returns a view of an input
_VIEW_BY_API: dict[str, int] = {}  # full API name -> 0 makes storages, 1 view op, 2 alias op


def _is_view_api(short: str) -> bool:
    """Whether an op returns views of its inputs: some overload of aten's op of that name returns
    an alias in its schema (``Tensor(a)``). Unknown names (Python-level functions) count as not."""
    hit = _VIEW_APIS.get(short)
    if hit is None:
        hit = False
        packet = getattr(torch.ops.aten, short, None) if short.isidentifier() else None
        if packet is not None:
            with contextlib.suppress(Exception):
                hit = any(r.alias_info is not None and not r.alias_info.is_write
                          for ol in packet.overloads() for r in getattr(packet, ol)._schema.returns)
        _VIEW_APIS[short] = hit
    return hit


def _round_block(size: int) -> int:
    # The caching allocator's block size for a request when the block is split to fit (512-byte
    # granules); an unsplit block can be larger, which only the end snapshot can tell.
    return 512 if size < 512 else (size + 511) // 512 * 512


def _cuda_stats(dev: int) -> dict[str, int]:
    s = torch._C._cuda_memoryStats(dev)
    req = s.get("requested_bytes", s["allocated_bytes"])["all"]
    return {"allocated": s["allocated_bytes"]["all"]["current"], "reserved": s["reserved_bytes"]["all"]["current"],
            "requested": req["current"], "req_alloc": req["allocated"], "req_freed": req["freed"]}


class MemoryListener(Listener):
    """Follows allocations and frees of a traced block; ``finish`` writes them into ``trace.memory``.

    ``cuda``: ``"auto"`` (history where this torch has allocation metadata, else deltas; CUDA is
    observed when it was initialised before the block), ``"history"``, ``"deltas"`` or ``"off"``.
    """

    def __init__(self, cuda: str = "auto") -> None:
        if cuda not in ("auto", "history", "deltas", "off"):
            raise ValueError(f"cuda must be 'auto', 'history', 'deltas' or 'off', got {cuda!r}")
        self._prefix = f"g{next(_listener_ids)}|"
        self._tls = threading.local()
        self._lock = threading.RLock()
        self._tokens = itertools.count()
        self._tok_prev: dict[int, Tag | None] = {}  # token -> the tag before it (for calls never closed)
        self._call_names: dict[int, str] = {}
        self._nodes: list[str] = []
        self._open_nodes: dict[str, int] = {}  # node name -> index of its running execution
        self._runs: list[str] = []
        self._raw: list[tuple[Any, ...]] = []  # (time_us, action, bytes, device, addr, allocated, reserved, tag, tensor)
        self._cpu_live: dict[int, tuple[Any, int, int, str | None]] = {}  # id(storage) -> (ref, nbytes, ptr, name)
        self._ref_key: dict[int, int] = {}  # id(weakref) -> id(storage)
        self._cpu_bytes = 0
        self._cuda_names: dict[tuple[Tag | None, int], str] = {}
        self._finished = False
        self.mode = "off"
        self._own_history = False
        self._set_md: Any = None
        self._hook: Any = None  # called with each new tag: sets the allocator's metadata, or reads its counters
        if cuda != "off" and torch.cuda.is_available() and torch.cuda.is_initialized():
            self._start_cuda(cuda)

    # ---- CUDA set-up -------------------------------------------------------------------------
    def _start_cuda(self, want: str) -> None:
        self._devices = list(range(torch.cuda.device_count()))
        try:
            self._stats0 = {d: _cuda_stats(d) for d in self._devices}
        except (RuntimeError, KeyError, AttributeError):  # a pluggable allocator without statistics
            return
        if want in ("auto", "history") and _cuda_history_api():
            try:
                self._blocks0 = {b["address"]: b["size"] for seg in torch.cuda.memory_snapshot()
                                 for b in seg["blocks"] if b["state"] != "inactive"}
                enabled = getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)()
                if not enabled:  # a history the user runs stays as it is; ours is filtered by tag
                    self._enable_history()
                    self._own_history = True
                self._set_md = torch._C._cuda_setMemoryMetadata
                self._hook = self._md_hook
                self.mode = "history"
                self._set_tag(("s", 0))  # the block, before its first call
                return
            except (RuntimeError, TypeError, AttributeError):
                if want == "history":
                    raise
        dev = torch.cuda.current_device()
        self._delta_dev = dev
        self._delta_last = self._stats0[dev]
        self._delta_tag: Tag | None = None
        self._hook = self._delta_mark
        self.mode = "deltas"

    @staticmethod
    def _enable_history() -> None:

        try:
            cm._record_memory_history(enabled="all", context=None, stacks="python", max_entries=4_000_000,
                                      clear_history=True)
        except TypeError:  # a torch whose history has no clear_history switch
            cm._record_memory_history(enabled="all", context=None, stacks="python", max_entries=4_000_000)

    # ---- tags --------------------------------------------------------------------------------
    # Each thread has one current tag (threading.local, like the allocator's metadata). A call
    # sets its own tag while it runs; when it ends, a call nested in a custom Function or a grad
    # node (``call.parent``) gives the tag back to what ran before it, any other call leaves
    # "after me". A call announced but never finished (a metadata query, one that raised) is
    # resolved to the tag before it, at the end.
    def _set_tag(self, tag: Tag | None) -> None:
        self._tls.tag = tag
        if self._hook is not None:
            self._hook(tag)

    def _md_hook(self, tag: Tag | None) -> None:
        self._set_md("" if tag is None else f"{self._prefix}{tag[0]}{tag[1]}")

    def _tag(self) -> Tag | None:
        return getattr(self._tls, "tag", None)

    # ---- listener events ---------------------------------------------------------------------
    def before_call(self) -> Any:
        # The hot path: kept to a few attribute operations.
        if self._finished:
            return None
        tls = self._tls
        tok = next(self._tokens)
        self._tok_prev[tok] = getattr(tls, "tag", None)
        tls.tag = tag = ("c", tok)
        if self._hook is not None:
            self._hook(tag)
        return tok

    def on_call(self, trace: Trace, call: Call, token: Any, outputs: list[torch.Tensor]) -> None:
        if self._finished:
            return
        if token is None:  # a call the recorder did not announce (a compiled region)
            token = next(self._tokens)
            self._tok_prev[token] = self._tag()
        self._call_names[token] = call.name
        if outputs:
            self._track_outputs(trace, call, outputs, ("c", token))
        self._tls.tag = tag = self._tok_prev[token] if call.parent is not None else ("a", token)
        if self._hook is not None:
            self._hook(tag)

    def on_backward_begin(self, trace: Trace, run: BackwardRun) -> None:
        if self._finished:
            return
        with self._lock:
            idx = len(self._runs)
            self._runs.append(run.name)
        self._set_tag(("b", idx))

    def on_backward_end(self, trace: Trace, run: BackwardRun, error: BaseException | None) -> None:
        if self._finished:
            return
        idx = len(self._runs) - 1 - self._runs[::-1].index(run.name) if run.name in self._runs else -1
        self._set_tag(("B", idx))

    def on_node_begin(self, trace: Trace, node: str, step: NodeRun, grads: tuple[Any, ...]) -> None:
        if self._finished:
            return
        before = self._tag()
        # Gradients first seen here were made before the node ran, by what ran before it (views
        # of storages already known are skipped by storage).
        names = step.grads_in
        for i, g in enumerate(grads):
            if isinstance(g, torch.Tensor):
                self._new_storage(g, names[i] if i < len(names) else None, before)
        with self._lock:
            idx = len(self._nodes)
            self._nodes.append(node)
            self._open_nodes[node] = idx
        self._set_tag(("n", idx))

    def on_node_end(self, trace: Trace, node: str, step: NodeRun, grads: tuple[Any, ...]) -> None:
        if self._finished:
            return
        idx = self._open_nodes.pop(node, None)
        if idx is None:
            return
        names = step.grads_out
        for j, g in enumerate(grads):
            if isinstance(g, torch.Tensor):
                self._new_storage(g, names[j] if j < len(names) else None, ("n", idx))
        self._set_tag(("m", idx))

    # ---- storages ----------------------------------------------------------------------------
    def _track_outputs(self, trace: Trace, call: Call, outputs: list[torch.Tensor], tag: Tag) -> None:
        view_api = _VIEW_BY_API.get(call.api)
        if view_api is None:
            short = call.api.rsplit(".", 1)[-1]
            view_api = _VIEW_BY_API[call.api] = 2 if short in _ALIAS_APIS else int(_is_view_api(short))
        if view_api == 2:
            return
        names = call.outputs
        for t, name in zip(outputs, names):  # outputs beyond the names are inputs changed in place
            # A view op's view shares an input's storage; any other op's view (einsum's permuted
            # result) is a view of a storage the op just made.
            if (view_api and t._base is not None) or name in call.inputs:
                continue
            rec = trace.tensors.get(name)
            if rec is None or rec.producer != call.name or rec.previous is not None:
                continue  # a name the tensor already had: not a storage made here
            self._new_storage(t, name, tag)

    def _new_storage(self, t: torch.Tensor, name: str | None, tag: Tag | None) -> None:
        try:
            if not t.is_cpu:
                if t.is_cuda and self._set_md is not None and name is not None:
                    # history: name the block at its address (the storage's start)
                    self._cuda_names[(tag, int(t.data_ptr() - t.storage_offset() * t.element_size()))] = name
                return
            s = t.untyped_storage()
            if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and s.device.type != "cpu":
                return  # fake tensors hold no memory
            key = id(s)
            if key in self._cpu_live:
                return
            nbytes = s.nbytes()
            ptr = s.data_ptr()
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            return  # sparse, nested and other tensors without one plain storage
        if not nbytes:
            return
        ref = weakref.ref(s, self._on_cpu_free)
        t_us = time.time_ns() // 1000 if self.mode != "off" else 0  # only to merge with CUDA events
        with self._lock:
            self._cpu_live[key] = (ref, nbytes, ptr, name)
            self._ref_key[id(ref)] = key
            self._cpu_bytes += nbytes
            self._raw.append((t_us, "alloc", nbytes, "cpu", ptr, self._cpu_bytes, None, tag, name))

    def _on_cpu_free(self, ref: Any) -> None:
        # Runs where the storage dies, on the thread that dropped the last reference.
        with self._lock:
            key = self._ref_key.pop(id(ref), None)
            if key is None:
                return
            _ref, nbytes, ptr, name = self._cpu_live.pop(key)
            self._cpu_bytes -= nbytes
            tag = self._tag()
            t_us = time.time_ns() // 1000 if self.mode != "off" else 0
            self._raw.append((t_us, "free", nbytes, "cpu", ptr, self._cpu_bytes, None, tag, name))

    # ---- CUDA counters (deltas mode) ---------------------------------------------------------
    def _delta_mark(self, tag: Tag | None) -> None:
        with self._lock:
            now = _cuda_stats(self._delta_dev)
            last, self._delta_last = self._delta_last, now
            old, self._delta_tag = self._delta_tag, tag
            da = now["req_alloc"] - last["req_alloc"]
            df = now["req_freed"] - last["req_freed"]
            t_us = time.time_ns() // 1000
            dev = f"cuda:{self._delta_dev}"
            if da:
                self._raw.append((t_us, "alloc", da, dev, None, now["allocated"], now["reserved"], old, None))
            if df:
                self._raw.append((t_us, "free", df, dev, None, now["allocated"], now["reserved"], old, None))

    # ---- end of the block --------------------------------------------------------------------
    def finish(self, trace: Trace) -> None:
        if self._finished:
            return
        with self._lock:
            self._finished = True
            live, self._cpu_live, self._ref_key = self._cpu_live, {}, {}
        del live  # the weak references go with it: frees after the block are not ours
        markers: list[dict[str, Any]] = []
        cuda_events: list[tuple[Any, ...]] = []
        if self.mode == "history":
            cuda_events, markers = self._collect_history(trace)
        elif self.mode == "deltas":
            self._set_tag(None)  # closes the last interval
            markers = self._cuda_markers([self._delta_dev])
        cpu_start = {"action": "start", "device": "cpu", "allocated_after": 0, "reserved_after": None,
                     "source": "storages"}
        cpu_end = {"action": "end", "device": "cpu", "allocated_after": self._cpu_bytes, "reserved_after": None,
                   "source": "storages"}
        raw = sorted(self._raw + cuda_events, key=lambda r: r[0])  # stable: each device keeps its order
        phases = {c.name: c.phase for c in trace.calls}
        events: list[dict[str, Any]] = []
        for m in [cpu_start, *[m for m in markers if m["action"] == "start"]]:
            events.append(self._marker(len(events), m))
        resolved: dict[Tag | None, tuple[str | None, bool, str]] = {}
        for _t, action, nbytes, dev, addr, alloc, reserved, tag, tensor in raw:
            hit = resolved.get(tag)
            if hit is None:
                hit = resolved[tag] = self._resolve(tag)
            owner, after, kind = hit
            phase = "backward" if kind in _BACKWARD_KINDS else phases.get(owner or "", "forward")
            events.append({"seq": len(events), "action": action, "bytes": nbytes, "device": dev, "addr": addr,
                           "allocated_after": alloc, "reserved_after": reserved, "owner": owner, "after": after,
                           "phase": phase, "tensor": tensor})
        for m in [cpu_end, *[m for m in markers if m["action"] == "end"]]:
            events.append(self._marker(len(events), m))
        trace.memory[:] = cast(list[MemoryEvent], events)
        self._raw = []

    @staticmethod
    def _marker(seq: int, m: dict[str, Any]) -> dict[str, Any]:
        return {"seq": seq, "action": m["action"], "bytes": 0, "device": m["device"], "addr": None,
                "allocated_after": m["allocated_after"], "reserved_after": m["reserved_after"], "owner": None,
                "after": False, "phase": "forward", "tensor": None, "source": m["source"],
                **({"requested": m["requested"]} if "requested" in m else {})}

    def _cuda_markers(self, devices: list[int], end: dict[int, dict[str, int]] | None = None) -> list[dict[str, Any]]:
        """The start and end markers of each device; ``end``: the figures read with the history
        (else read now)."""
        out = []
        for d in devices:
            s0, s1 = self._stats0[d], (end[d] if end is not None and d in end else _cuda_stats(d))
            for action, s in (("start", s0), ("end", s1)):
                out.append({"action": action, "device": f"cuda:{d}", "allocated_after": s["allocated"],
                            "reserved_after": s["reserved"], "requested": s["requested"], "source": self.mode})
        return out

    def _collect_history(self, trace: Trace) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:

        # The history and the end figures are read together, with the cycle collector held off:
        # a collection between them (thresholds are back to the user's by now) freed a tensor held
        # in a cycle after the history ended and before the figures were read, so the record's
        # net bytes and the allocator's disagreed (by 2,176 bytes on a GPT-2 step on an H100).
        collecting = gc.isenabled()
        gc.disable()
        try:
            snap = cm._snapshot()
            end_stats = {d: _cuda_stats(d) for d in self._stats0}
        finally:
            if collecting:
                gc.enable()
            self._set_md("")
            if self._own_history:
                cm._record_memory_history(enabled=None)
        end_blocks = {b["address"]: b["size"] for seg in snap.get("segments", []) for b in seg["blocks"]
                      if b["state"] != "inactive"}
        prefix, plen = self._prefix, len(self._prefix)
        out: list[tuple[Any, ...]] = []
        seen: set[int] = set()
        for d, entries in enumerate(snap.get("device_traces", [])):
            if d not in self._stats0:
                continue
            alloc, reserved = self._stats0[d]["allocated"], self._stats0[d]["reserved"]
            live: dict[int, int] = {}
            dev = f"cuda:{d}"
            started = self._own_history
            # Only the last alloc at an address can be the block the end snapshot shows there.
            last_alloc = {e["addr"]: i for i, e in enumerate(entries) if e["action"] == "alloc"}
            for i, e in enumerate(entries):
                md = e.get("user_metadata", "")
                if not started:  # a history the user had running: ours starts with our first tag
                    if not md.startswith(prefix):
                        continue
                    started = True
                action = e["action"]
                tag: Tag | None = None
                if md.startswith(prefix) and md[plen + 1:].isdigit():
                    tag = (md[plen], int(md[plen + 1:]))
                if action == "alloc":
                    addr, size = e["addr"], e["size"]
                    blk = end_blocks.get(addr, _round_block(size)) if last_alloc[addr] == i else _round_block(size)
                    live[addr] = blk
                    alloc += blk
                    out.append((e.get("time_us", 0), "alloc", size, dev, addr, alloc, reserved, tag,
                                self._cuda_names.get((tag, addr))))
                elif action == "free_requested":
                    addr, size = e["addr"], e["size"]
                    blk = live.pop(addr, None)
                    if blk is None:  # a block from before the block
                        blk = self._blocks0.get(addr, _round_block(size))
                    alloc -= blk
                    out.append((e.get("time_us", 0), "free", size, dev, addr, alloc, reserved, tag, None))
                elif action in ("segment_alloc", "segment_map"):
                    reserved += e["size"]
                elif action in ("segment_free", "segment_unmap"):
                    reserved -= e["size"]
                elif action == "oom":
                    trace.notes.append(f"memory: out of memory on {dev} asking for {e.get('size')} bytes")
                else:
                    continue
                seen.add(d)
            if len(entries) >= 4_000_000:
                trace.notes.append(f"memory: the allocator's history of {dev} filled up; the oldest events are lost")
        seen.add(torch.cuda.current_device())
        # Name the tensor of each free after the alloc it pairs with.
        names: dict[tuple[str, int], str | None] = {}
        fixed = []
        for r in out:
            if r[1] == "alloc":
                names[(r[3], r[4])] = r[8]
                fixed.append(r)
            else:
                fixed.append((*r[:8], names.pop((r[3], r[4]), None)))
        return fixed, self._cuda_markers(sorted(seen), end_stats)

    def _resolve(self, tag: Tag | None) -> tuple[str | None, bool, str]:
        """(owner, after, kind) of a tag; calls never closed take the tag that was before them."""
        after = False
        for _ in range(len(self._tok_prev) + 1):
            if tag is None:
                return None, after, ""
            kind, idx = tag
            if kind in "ca":
                name = self._call_names.get(idx)
                if name is not None:
                    return name, after or kind == "a", kind
                tag = self._tok_prev.get(idx)  # it ran nothing of its own (a metadata query, or it raised)
                continue
            if kind == "s":
                return None, after, kind
            names = self._nodes if kind in "nm" else self._runs
            if 0 <= idx < len(names):
                return names[idx], after or kind in "mB", kind
            return None, after, kind
        return None, after, ""


def memory_summary(device: Any = None) -> MemorySummary:
    """The memory state now: the caching allocator's figures on CUDA, what can be known on CPU.

    ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, an index or a ``torch.device``; by default the
    current CUDA device when CUDA is initialised, else the CPU.
    """
    if device is None:
        dev = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() and torch.cuda.is_initialized() else torch.device("cpu")
    elif isinstance(device, int):
        dev = torch.device("cuda", device)
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cuda":
        return _cuda_summary(dev)
    if dev.type == "cpu":
        return _cpu_summary()
    raise ValueError(f"memory_summary: no memory figures for device {dev}")


def _cuda_summary(dev: torch.device) -> MemorySummary:
    st = torch.cuda.memory_stats(dev)
    free_dev, total_dev = torch.cuda.mem_get_info(dev)
    segments = [s for s in torch.cuda.memory_snapshot() if s.get("device", dev.index) == dev.index]
    pools: dict[str, dict[str, int]] = {}
    dist: list[dict[str, Any]] = [{"bucket": bucket_label(i), "used": 0, "used_bytes": 0, "free": 0, "free_bytes": 0}
            for i in range(len(BUCKETS))]
    largest_free = 0
    free_total = 0
    for seg in segments:
        p = pools.setdefault(seg["segment_type"], {"segments": 0, "segment_bytes": 0, "used": 0, "used_bytes": 0,
                                                   "free": 0, "free_bytes": 0})
        p["segments"] += 1
        p["segment_bytes"] += seg["total_size"]
        for b in seg["blocks"]:
            used = b["state"] != "inactive"
            key = "used" if used else "free"
            p[key] += 1
            p[f"{key}_bytes"] += b["size"]
            i = max(k for k, lo in enumerate(BUCKETS) if b["size"] >= lo)
            dist[i][key] += 1
            dist[i][f"{key}_bytes"] += b["size"]
            if not used:
                largest_free = max(largest_free, b["size"])
                free_total += b["size"]
    allocated = st.get("allocated_bytes.all.current", 0)
    reserved = st.get("reserved_bytes.all.current", 0)
    settings: dict[str, Any] = {}
    try:
        settings = dict(torch.cuda.memory._snapshot().get("allocator_settings", {}))
    except Exception:  # older torch: no settings in the snapshot
        pass
    return MemorySummary({
        "device": str(dev),
        "allocated": allocated,
        "max_allocated": st.get("allocated_bytes.all.peak", 0),
        "reserved": reserved,
        "max_reserved": st.get("reserved_bytes.all.peak", 0),
        "requested": st.get("requested_bytes.all.current"),
        "active": st.get("active_bytes.all.current", 0),
        "inactive_split": st.get("inactive_split_bytes.all.current", 0),
        # 1 - allocated/reserved: the share of the cache not holding tensors.
        "fragmentation": (1.0 - allocated / reserved) if reserved else 0.0,
        # 1 - largest free block / all free cached bytes: 0 when the free cache is one block.
        "free_fragmentation": (1.0 - largest_free / free_total) if free_total else 0.0,
        "largest_free_block": largest_free,
        "cached_free": free_total,
        "device_total": total_dev,
        "device_used": total_dev - free_dev,
        "allocs": st.get("allocation.all.allocated", 0),
        "num_alloc_retries": st.get("num_alloc_retries", 0),
        "num_ooms": st.get("num_ooms", 0),
        "expandable_segments": bool(settings.get("expandable_segments", False)),
        "pools": pools,
        "distribution": dist,
        "unknown": [],
    })


def _cpu_summary() -> MemorySummary:
    seen: set[int] = set()
    live = 0
    count = 0
    with contextlib.suppress(Exception):
        for obj in gc.get_objects():
            # type(), not isinstance: some module-level objects warn when asked for __class__.
            if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
                try:
                    s = obj.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                if id(s) not in seen and s.device.type == "cpu":
                    seen.add(id(s))
                    live += s.nbytes()
                    count += 1
    rss, peak_rss = _rss()
    return MemorySummary({
        "device": "cpu",
        "tensor_bytes": live,
        "tensor_storages": count,
        "rss": rss,
        "max_rss": peak_rss,
        "unknown": [
            "PyTorch's CPU allocator keeps no statistics: no reserved/cached bytes, pools, blocks or fragmentation",
            "tensor bytes count storages of tensors Python can reach; tensors held only inside autograd "
            "(saved for backward) or by C++ are missing",
            "RSS includes the interpreter, libraries and memory the allocator has not returned to the system",
        ],
    })


def _rss() -> tuple[int | None, int | None]:
    rss = None
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    except (ImportError, OSError):
        peak = None
    return rss, peak
