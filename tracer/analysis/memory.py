"""Memory records: every allocation and free of a traced block, attributed to the call or grad node
that made it, as users read them (tables, peak, CSV, plot).

    with tracer.record_memory() as rec:          # or tracer.trace(memory=True) / MemoryRecord.from_trace
        loss = model(x).pow(2).mean(); loss.backward()
    print(rec.table()); rec.peak; rec.to_csv("mem.csv"); rec.plot("mem.png")

How the events are recorded on each device, how they are attributed, and the fields of each event
(``Trace.memory``): the docstring of ``tracer.features.memory``, which records them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracer.analysis import memory_views as views
from tracer.analysis import reprs
from tracer.model import GradNode, MemoryEvent, Trace
from tracer.model.display import format_bytes, param_module, plural


# ---- the record as users see it ----------------------------------------------------------------
@dataclass
class PeakTensor:
    """One tensor live at the peak: its name (None: unnamed), bytes, producer and allocating owner."""

    name: str | None
    bytes: int
    producer: str | None
    owner: str | None

    @property
    def label(self) -> str:
        """The name, or what is known of a block no tensor name was seen for (an op's temporary,
        a library workspace)."""
        return self.name or f"(unnamed, from {self.owner or 'unknown'})"


@dataclass
class Peak:
    """The highest point of ``allocated_after`` on one device and what was live then."""

    device: str
    seq: int
    allocated: int
    reserved: int | None
    owner: str | None
    phase: str
    tensors: list[PeakTensor] = field(default_factory=list)
    untracked: int = 0  # bytes allocated then that no event of the record accounts for (from before it)

    def __str__(self) -> str:
        top = ", ".join(f"{t.label} {format_bytes(t.bytes)}" for t in self.tensors[:3])
        return (f"peak {format_bytes(self.allocated)} on {self.device} at #{self.seq} ({self.phase}, "
                f"{self.owner or 'unknown'}); largest live: {top or 'none tracked'}")


class MemoryRecord:
    """The allocation and free events of one traced block, with views of them.

    ``events``: the dicts described in this module's docstring; ``trace``: the trace they belong to
    (module paths, stacks and producers come from it).
    """

    def __init__(self, events: list[MemoryEvent] | None = None, trace: Trace | None = None) -> None:
        self.events: list[MemoryEvent] = list(events or [])
        self.trace = trace
        self._peak: Peak | None = None

    @classmethod
    def from_trace(cls, trace: Trace) -> MemoryRecord:
        return cls(trace.memory, trace)

    def fill(self, trace: Trace) -> None:
        """Take the events of ``trace`` (``record_memory`` fills its record when the block ends)."""
        self.events = list(trace.memory)
        self.trace = trace
        self._peak = None

    # ---- figures ---------------------------------------------------------------------------------
    @property
    def allocs(self) -> list[MemoryEvent]:
        return [e for e in self.events if e["action"] == "alloc"]

    @property
    def frees(self) -> list[MemoryEvent]:
        return [e for e in self.events if e["action"] == "free"]

    def devices(self) -> list[str]:
        """Devices with events, the one with the most allocated bytes first."""
        by: dict[str, int] = {}
        for e in self.events:
            if e["action"] in ("alloc", "free"):
                by[e["device"]] = by.get(e["device"], 0) + (e["bytes"] if e["action"] == "alloc" else 0)
        return sorted(by, key=lambda d: (-by[d], d))

    def net(self, device: str | None = None) -> int:
        """Bytes allocated minus bytes freed in the block (on one device, or all)."""
        return sum(e["bytes"] if e["action"] == "alloc" else -e["bytes"] for e in self.events
                   if e["action"] in ("alloc", "free") and (device is None or e["device"] == device))

    def marker(self, action: str, device: str) -> MemoryEvent | None:
        return next((e for e in self.events if e["action"] == action and e["device"] == device), None)

    def source(self, device: str) -> str | None:
        m = self.marker("start", device)
        return None if m is None else m.get("source")

    def by_owner(self) -> dict[str | None, dict[str, int]]:
        """owner -> {allocs, alloc_bytes, frees, free_bytes}."""
        out: dict[str | None, dict[str, int]] = {}
        for e in self.events:
            if e["action"] not in ("alloc", "free"):
                continue
            d = out.setdefault(e["owner"], {"allocs": 0, "alloc_bytes": 0, "frees": 0, "free_bytes": 0})
            if e["action"] == "alloc":
                d["allocs"] += 1
                d["alloc_bytes"] += e["bytes"]
            else:
                d["frees"] += 1
                d["free_bytes"] += e["bytes"]
        return out

    def attributed_fraction(self, device: str | None = None, inside_only: bool = False) -> float:
        """Share of allocated bytes whose owner is a named call, grad node or backward run."""
        allocs = [e for e in self.allocs if device is None or e["device"] == device]
        total = sum(e["bytes"] for e in allocs)
        named = sum(e["bytes"] for e in allocs if e["owner"] is not None and not (inside_only and e.get("after")))
        return named / total if total else 1.0

    # ---- owners' context from the trace ----------------------------------------------------------
    def owner_kind(self, owner: str | None) -> str:
        if owner is None:
            return ""
        rec = self.trace.get(owner) if self.trace is not None else None
        if rec is None:
            return "node" if "/" in owner else ("backward" if owner.startswith(("backward", "grad")) else "call")
        return {"Call": "call", "GradNode": "node", "BackwardRun": "backward"}.get(type(rec).__name__, "")

    def module_of(self, owner: str | None) -> str | None:
        """Module path of an owner (a grad node: its call's module); None where there is none."""
        if owner is None or self.trace is None:
            return None
        rec = self.trace.get(owner)
        call = getattr(rec, "call", None)
        if isinstance(call, str):
            rec = self.trace.get(call)
        elif isinstance(rec, GradNode) and rec.param:  # a leaf's accumulator: the module owning the parameter
            return param_module(rec.param)
        module = getattr(rec, "module", None)
        return module if isinstance(module, str) else None

    def stack_of(self, owner: str | None) -> tuple[Any, ...]:
        if owner is None or self.trace is None:
            return ()
        rec = self.trace.get(owner)
        stack = getattr(rec, "stack", ())
        if not stack and isinstance(rec, GradNode) and rec.call:
            stack = getattr(self.trace.get(rec.call), "stack", ())
        return tuple(stack)

    # ---- the peak --------------------------------------------------------------------------------
    @property
    def peak(self) -> Peak | None:
        """The peak of the busiest device (most bytes allocated), or None without events."""
        if self._peak is None:
            devs = self.devices()
            if devs:
                self._peak = self.peak_of(devs[0])
        return self._peak

    def peak_of(self, device: str) -> Peak | None:
        evs = [e for e in self.events if e["device"] == device and e["action"] in ("alloc", "free", "start")]
        if not evs:
            return None
        best = max(range(len(evs)), key=lambda i: (evs[i]["allocated_after"] or 0, -i))
        live: dict[Any, MemoryEvent] = {}
        for e in evs[:best + 1]:
            if e["action"] == "alloc":
                live[e["addr"]] = e
            elif e["action"] == "free":
                live.pop(e["addr"], None)
        at = evs[best]
        tensors = []
        for e in sorted(live.values(), key=lambda e: (-e["bytes"], e["seq"])):
            name = e.get("tensor")
            trec = self.trace.tensors.get(name) if self.trace is not None and name else None
            tensors.append(PeakTensor(name, e["bytes"], trec.producer if trec is not None else e["owner"], e["owner"]))
        tracked = sum(t.bytes for t in tensors)
        return Peak(device=device, seq=at["seq"], allocated=at["allocated_after"] or 0,
                    reserved=at["reserved_after"], owner=at["owner"], phase=at["phase"], tensors=tensors,
                    untracked=max(0, (at["allocated_after"] or 0) - tracked))

    # ---- views -----------------------------------------------------------------------------------
    def table(self, top: int = 15) -> Any:
        """Rich tables: totals, top allocators, per module, forward vs backward, the peak."""
        return views.record_tables(self, top=top)

    def to_csv(self, path: str) -> None:
        """One row per event (``CSV_FIELDS``), with the owner's module, kind and user line."""
        views.write_csv(self, path)

    def plot(self, path: str) -> None:
        """Allocated (and reserved) over the events, backward shaded, peak marked: PNG or SVG."""
        views.plot_record(self, path)

    def __repr__(self) -> str:
        peak = self.peak
        return (f"<MemoryRecord {plural(len(self.allocs), 'alloc')}, {plural(len(self.frees), 'free')}, "
                f"net {format_bytes(self.net())}"
                f"{'' if peak is None else f', peak {format_bytes(peak.allocated)} on {peak.device}'}>")


    def _repr_html_(self) -> str:
        """The notebook card: events, the peak and the top allocators (tracer/analysis/reprs.py)."""
        return reprs.memory_html(self)

# ---- the allocator's state, as memory_summary() reports it ----------------------------------------
# Block-size buckets of the distribution (lower bounds in bytes), as in Paddle's memory summary.
_MiB, _GiB = 1 << 20, 1 << 30
BUCKETS = (0, _MiB, 4 * _MiB, 16 * _MiB, 64 * _MiB, 256 * _MiB, _GiB, 3 * _GiB)


def bucket_label(i: int) -> str:
    lo = BUCKETS[i]
    hi = BUCKETS[i + 1] if i + 1 < len(BUCKETS) else None
    return f"[{format_bytes(lo, exact=True)}, {'∞' if hi is None else format_bytes(hi, exact=True)})"


class MemorySummary(dict):  # type: ignore[type-arg]
    """A dict of figures that prints as rich tables (``print(summary)``; ``summary["allocated"]``)."""

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield views.summary_tables(self)

    def __str__(self) -> str:
        return views.render_text(self)




def memory_timeline_data(trace: Trace, device: str | None = None, max_points: int = 4000) -> dict[str, Any]:
    """The HTML report's memory timeline of a trace (see ``memory_views.timeline_of``)."""
    return views.timeline_of(MemoryRecord.from_trace(trace), device, max_points)
