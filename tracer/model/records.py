"""The records of a trace: plain, versioned data shared by ``tracer`` and ``export``.

Everything here is data. Nothing holds a tensor, a frame or a module; a trace that was just
recorded and a trace loaded from disk are the same kind of object, so every exporter renders
both alike. The on-disk form of each record is its ``to_json()`` dict, one JSON object per line
(see ``docs/trace-format.md``); ``from_json`` is its inverse and validates what it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, get_args

from tracer.model import reprs
from tracer.model.values import decode_values, encode_values

FORMAT = "gradtrace"
SCHEMA_VERSION = 3

# The closed vocabularies of the records (a file with another value is refused on load).
Role = Literal["output", "param", "buffer", "input", "grad", "state"]
CallKind = Literal["op", "function", "custom_op", "compiled", "collective", "optimizer"]
# The phases of a step, in the order a step runs them: the forward pass, the backward runs, and
# what runs after the last backward on the gradients, parameters and optimizer state (clipping,
# unscaling, the optimizer step, EMA, zero_grad). docs/trace-format.md says where each begins.
Phase = Literal["forward", "backward", "optimizer"]
RunStatus = Literal["ok", "failed"]
TraceStatus = Literal["ok", "failed", "truncated"]
ROLES: tuple[Role, ...] = get_args(Role)
# The roles of tensors named by their place in the program, which outlive a step: parameters,
# buffers and optimizer state (their name, and role, is kept through writes by any alias).
OWNED_ROLES: frozenset[str] = frozenset({"param", "buffer", "state"})
CALL_KINDS: tuple[CallKind, ...] = get_args(CallKind)
PHASES: tuple[Phase, ...] = get_args(Phase)
RUN_STATUSES: tuple[RunStatus, ...] = get_args(RunStatus)
TRACE_STATUSES: tuple[TraceStatus, ...] = get_args(TraceStatus)


class TraceFormatError(ValueError):
    """A trace file or record that cannot be read: corrupt, foreign, or from a newer version."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One Python frame of a call stack, symbolised (file, line, function, source text)."""

    file: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        return f'File "{self.file}", line {self.line}, in {self.function}\n    {self.code}'

    def to_json(self, frame_id: int) -> dict[str, Any]:
        return {"t": "frame", "id": frame_id, "file": self.file, "line": self.line,
                "function": self.function, "code": self.code}


@dataclass(slots=True)
class Stats:
    """Summary of a tensor's values. min/max/mean/absmax are over finite values only."""

    min: float | None
    max: float | None
    mean: float | None
    absmax: float | None
    nan: int = 0
    inf: int = 0

    def to_json(self) -> list[Any]:
        return [self.min, self.max, self.mean, self.absmax, self.nan, self.inf]

    @classmethod
    def from_json(cls, data: list[Any]) -> Stats:
        if not isinstance(data, list) or len(data) != 6:
            raise TraceFormatError("stats must be a list of 6 numbers")
        values = data[:4]
        if not all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values):
            raise TraceFormatError("stats: min, max, mean and absmax must be numbers or null")
        nan, inf = data[4], data[5]
        if not all(_is_count(v) for v in (nan, inf)):
            raise TraceFormatError("stats: the NaN and Inf counts must be integers from 0 to 2**63-1")
        return cls(values[0], values[1], values[2], values[3], nan, inf)

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0


@dataclass(frozen=True, slots=True)
class Sharding:
    """How a distributed tensor (``torch.distributed.tensor.DTensor``) is laid out over its device
    mesh, as seen on the rank that recorded it. The record's ``shape`` is the global shape; its
    checksum and stats are of this rank's local shard (``DTensor.to_local()``).

    ``placements`` has one entry per mesh dimension: ``Shard(d)`` (split along tensor dim ``d``),
    ``Replicate()`` (the same on every rank of that mesh dimension) or ``Partial(<op>)`` (a
    pending reduction: each rank holds a summand). ``mesh_ranks`` are the global ranks of the
    mesh, row-major; ``coordinate`` is this rank's position in it (None when not a member).
    """

    placements: tuple[str, ...]
    mesh_dims: tuple[str | None, ...]
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    coordinate: tuple[int, ...] | None
    local_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the local shard."""
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    def replica_key(self) -> tuple[Any, ...]:
        """What a rank holding the same bytes must share with this one: the mesh, the placements
        and the coordinate on every dimension that is not ``Replicate()`` (ranks that differ only
        along replicated dimensions hold copies of one shard)."""
        coord = self.coordinate or ()
        kept = tuple(c if not p.startswith("Replicate") else "*" for c, p in zip(coord, self.placements))
        return (self.mesh_ranks, self.mesh_shape, self.placements, kept)

    def describe(self) -> str:
        """``Shard(0)@dp, Replicate()@tp on mesh dp=2 x tp=2`` (dimensions without a name: ``dim<i>``)."""
        dims = [d or f"dim{i}" for i, d in enumerate(self.mesh_dims)]
        placed = ", ".join(f"{p}@{d}" for p, d in zip(self.placements, dims))
        return f"{placed} on mesh {' x '.join(f'{d}={n}' for d, n in zip(dims, self.mesh_shape))}"

    def to_json(self) -> dict[str, Any]:
        return {"placements": list(self.placements), "mesh_dims": list(self.mesh_dims),
                "mesh_shape": list(self.mesh_shape), "mesh_ranks": list(self.mesh_ranks),
                "coordinate": None if self.coordinate is None else list(self.coordinate),
                "local_shape": list(self.local_shape)}

    @classmethod
    def from_json(cls, d: Any) -> Sharding:
        if not isinstance(d, dict):
            raise TraceFormatError(f"sharding must be an object, got {d!r}")
        d = {"t": "tensor sharding", **d}
        _require(d, "placements", "mesh_shape", "mesh_ranks", "local_shape")
        dims = d.get("mesh_dims") or [None] * len(d["mesh_shape"])
        if not isinstance(dims, list) or not all(x is None or isinstance(x, str) for x in dims):
            raise TraceFormatError("tensor sharding: 'mesh_dims' must be a list of names or nulls")
        coord = None if d.get("coordinate") is None else tuple(_ints(d, "coordinate"))
        return cls(tuple(_strs(d, "placements")), tuple(dims), _shape(d, "mesh_shape"),
                   tuple(_ints(d, "mesh_ranks")), coord, _shape(d, "local_shape"))


# Field order matters: the recorder builds these positionally on its hot path
# (tests/test_recorder_fastpaths.py checks the order).
@dataclass(slots=True)
class TensorRecord:
    """One tensor value (a version of a tensor) seen by the trace.

    ``role`` says where it came from: ``output`` of a forward call, ``param``/``buffer`` of a
    module, ``input`` from outside the traced block, ``grad`` made by a backward run, ``state``
    of an optimizer. ``md5`` is the hex MD5 of the contiguous bytes in the tensor's own dtype;
    when a tensor could not be hashed ``md5`` is None and ``hash_note`` says why.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    role: Role
    producer: str | None = None
    stride: tuple[int, ...] | None = None
    contiguous: bool = True
    requires_grad: bool = False
    version: int = 0
    seq: int = 0
    md5: str | None = None
    fingerprint: str | None = None
    hash_note: str | None = None
    stats: Stats | None = None
    previous: str | None = None  # the name of the value this one replaced (in-place change)
    # Memory nobody wrote (``torch.empty_like``): no checksum, no stats, never compared.
    uninitialized: bool = False
    # A DTensor's layout; its md5/fingerprint/stats are then of this rank's local shard.
    sharding: Sharding | None = None
    # The value itself, kept only where ``trace(keep_values=...)`` asked for it: raw
    # little-endian bytes in ``dtype``, row-major (base64 text in the file).
    values: bytes | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    # How the record reads in a REPL and in a notebook (tracer/model/reprs.py).
    def __repr__(self) -> str:
        return reprs.tensor_repr(self)

    def _repr_html_(self) -> str:
        return reprs.tensor_html(self)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "t": "tensor", "name": self.name, "shape": list(self.shape), "dtype": self.dtype,
            "device": self.device, "role": self.role, "producer": self.producer,
            "stride": None if self.stride is None else list(self.stride),
            "contiguous": self.contiguous, "requires_grad": self.requires_grad,
            "version": self.version, "seq": self.seq, "md5": self.md5,
            "fingerprint": self.fingerprint, "hash_note": self.hash_note,
            "stats": None if self.stats is None else self.stats.to_json(),
            "previous": self.previous,
        }
        if self.uninitialized:
            out["uninitialized"] = True
        if self.sharding is not None:
            out["sharding"] = self.sharding.to_json()
        if self.values is not None:
            out["values"] = encode_values(self.values)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorRecord:
        _require(d, "name", "shape", "dtype", "device", "role")
        stats = d.get("stats")
        rec = cls(
            name=_str(d, "name"), shape=_shape(d, "shape"), dtype=_shared(_str(d, "dtype")),
            device=_shared(_str(d, "device")), role=_choice(d, "role", ROLES), producer=_opt_str(d, "producer"),
            stride=None if d.get("stride") is None else _dims(d, "stride"),
            contiguous=_bool(d, "contiguous", True), requires_grad=_bool(d, "requires_grad", False),
            version=_int(d, "version"), seq=_int(d, "seq"), md5=_opt_hex(d, "md5"),
            fingerprint=_opt_hex(d, "fingerprint"), hash_note=_opt_str(d, "hash_note"),
            stats=None if stats is None else Stats.from_json(stats),
            previous=_opt_str(d, "previous"), uninitialized=_bool(d, "uninitialized", False),
            sharding=None if d.get("sharding") is None else Sharding.from_json(d["sharding"]),
        )
        if d.get("values") is not None:
            try:
                rec.values = decode_values(d["values"], rec.dtype, rec.shape)
            except ValueError as exc:
                raise TraceFormatError(f"tensor record {rec.name[:80]!r}: {exc}") from None
        return rec


# Field order matters: the recorder builds these positionally on its hot path
# (tests/test_recorder_fastpaths.py checks the order).
@dataclass(slots=True)
class Call:
    """One forward API call (or custom Function / custom op) as the user wrote it.

    ``kind`` is ``op`` (torch function, tensor method or operator), ``function`` (a custom
    ``torch.autograd.Function``), ``custom_op`` (``torch.library``) or ``compiled`` (an opaque
    torch.compile region). ``phase`` is ``backward`` for calls made while a backward ran (a custom
    Function applied inside another one's backward, a hook, recomputation), ``optimizer`` for the
    optimizer step and the calls that work on gradients, parameters and optimizer state outside
    a module's forward (clipping, unscaling, EMA; see docs/trace-format.md, "Phases").
    ``parent`` names the enclosing custom Function call or grad node, which is how nesting is shown.
    """

    name: str
    api: str
    module: str
    inputs: list[str]
    outputs: list[str]
    args: str = ""
    grad_nodes: list[str] = field(default_factory=list)
    stack_id: int | None = None
    parent: str | None = None
    kind: CallKind = "op"
    phase: Phase = "forward"
    seq: int = 0
    mutated: list[str] = field(default_factory=list)
    error: str | None = None
    stack: tuple[Frame, ...] = field(default=(), compare=False, repr=False)

    # How the record reads in a REPL and in a notebook (tracer/model/reprs.py).
    def __repr__(self) -> str:
        return reprs.call_repr(self)

    def _repr_html_(self) -> str:
        return reprs.call_html(self)

    def to_json(self) -> dict[str, Any]:
        return {"t": "call", "name": self.name, "api": self.api, "module": self.module,
                "inputs": self.inputs, "outputs": self.outputs, "args": self.args,
                "grad_nodes": self.grad_nodes, "stack": self.stack_id, "parent": self.parent,
                "kind": self.kind, "phase": self.phase, "seq": self.seq, "mutated": self.mutated,
                "error": self.error}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Call:
        _require(d, "name", "api", "module", "inputs", "outputs")
        return cls(name=_str(d, "name"), api=_str(d, "api"), module=_path(d, "module"),
                   inputs=_strs(d, "inputs"), outputs=_strs(d, "outputs"), args=_str(d, "args", ""),
                   grad_nodes=_strs(d, "grad_nodes"), stack_id=_opt_int(d, "stack"),
                   parent=_opt_str(d, "parent"), kind=_choice(d, "kind", CALL_KINDS, "op"),
                   phase=_choice(d, "phase", PHASES, "forward"), seq=_int(d, "seq"),
                   mutated=_strs(d, "mutated"), error=_opt_str(d, "error"))


# Field order matters: the recorder builds these positionally on its hot path
# (tests/test_recorder_fastpaths.py checks the order).
@dataclass(slots=True)
class GradNode:
    """One autograd node created by the traced code, linked to the call that created it.

    ``kind`` is PyTorch's class name (``AddmmBackward0``, ``AccumulateGrad``, ``MyFnBackward``).
    A leaf accumulator has ``param`` set to the name of the tensor it accumulates into.
    ``next`` lists, for each of the node's outputs, the name of the node the gradient flows to
    (None where PyTorch has no edge). ``external`` nodes were created before the traced block.
    ``parent`` names the grad node whose backward created this one (a backward run with
    ``create_graph=True``, as in a gradient penalty); such a node has no ``call`` and its stack
    is the line that started that backward run.
    """

    name: str
    kind: str
    call: str | None
    param: str | None = None
    next: list[str | None] = field(default_factory=list)
    stack_id: int | None = None
    seq: int = 0
    external: bool = False
    parent: str | None = None
    stack: tuple[Frame, ...] = field(default=(), compare=False, repr=False)
    grads_in: list[str | None] = field(default_factory=list, compare=False, repr=False)
    grads_out: list[str | None] = field(default_factory=list, compare=False, repr=False)

    # How the record reads in a REPL and in a notebook (tracer/model/reprs.py).
    def __repr__(self) -> str:
        return reprs.node_repr(self)

    def _repr_html_(self) -> str:
        return reprs.node_html(self)

    def to_json(self) -> dict[str, Any]:
        out = {"t": "node", "name": self.name, "kind": self.kind, "call": self.call,
               "param": self.param, "next": self.next, "stack": self.stack_id, "seq": self.seq,
               "external": self.external}
        if self.parent is not None:
            out["parent"] = self.parent
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GradNode:
        _require(d, "name", "kind")
        return cls(name=_str(d, "name"), kind=_str(d, "kind"), call=_opt_str(d, "call"), param=_path(d, "param", None),
                   next=_opt_strs(d, "next"), stack_id=_opt_int(d, "stack"), seq=_int(d, "seq"),
                   external=_bool(d, "external", False), parent=_opt_str(d, "parent"))


@dataclass(slots=True)
class NodeRun:
    """One execution of a grad node in a backward run: the gradients it received and produced,
    and the calls its own code made (the ops of a custom Function's ``backward``)."""

    node: str
    grads_in: list[str | None]
    grads_out: list[str | None]
    calls: list[str] = field(default_factory=list)


@dataclass(slots=True)
class BackwardRun:
    """One call of ``Tensor.backward`` / ``torch.autograd.backward`` / ``torch.autograd.grad``."""

    name: str
    api: str
    roots: list[str]
    stack_id: int | None = None
    steps: list[NodeRun] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    status: RunStatus = "ok"
    error: str | None = None
    seq: int = 0
    stack: tuple[Frame, ...] = field(default=(), compare=False, repr=False)
    # The grad node whose own code started this run (``torch.autograd.grad`` inside a custom
    # backward, reentrant checkpointing): its steps ran inside that node's.
    parent: str | None = None
    # Where the run began among the calls: the ``seq`` the next call took (the calls before it ran
    # before it, its own calls and the later ones after). None in files of format version 2.
    at: int | None = None

    @property
    def order(self) -> list[str]:
        """Grad node names in the order the engine ran them."""
        return [s.node for s in self.steps]

    # How the record reads in a REPL and in a notebook (tracer/model/reprs.py).
    def __repr__(self) -> str:
        return reprs.backward_repr(self)

    def _repr_html_(self) -> str:
        return reprs.backward_html(self)

    def to_json(self) -> dict[str, Any]:
        out = {"t": "backward", "name": self.name, "api": self.api, "roots": self.roots,
               "stack": self.stack_id, "outputs": self.outputs, "status": self.status,
               "error": self.error, "seq": self.seq,
               "steps": [[s.node, s.grads_in, s.grads_out, s.calls] if s.calls else [s.node, s.grads_in, s.grads_out]
                         for s in self.steps]}
        if self.parent is not None:
            out["parent"] = self.parent
        if self.at is not None:
            out["at"] = self.at
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BackwardRun:
        _require(d, "name", "api", "roots")
        raw_steps = d.get("steps", [])
        if not isinstance(raw_steps, list):
            raise TraceFormatError("backward record: 'steps' must be a list")
        steps = []
        for i, s in enumerate(raw_steps):
            if not (isinstance(s, list) and len(s) in (3, 4) and isinstance(s[0], str)
                    and all(_is_name_list(x) for x in s[1:3])):
                raise TraceFormatError(f"backward record: step {i} must be [node, grads_in, grads_out(, calls)] "
                                       "with lists of names")
            calls = s[3] if len(s) == 4 else []
            if not (isinstance(calls, list) and all(isinstance(c, str) for c in calls)):
                raise TraceFormatError(f"backward record: the calls of step {i} must be a list of names")
            steps.append(NodeRun(s[0], list(s[1]), list(s[2]), list(calls)))
        return cls(name=_str(d, "name"), api=_str(d, "api"), roots=_strs(d, "roots"),
                   stack_id=_opt_int(d, "stack"), steps=steps, outputs=_strs(d, "outputs"),
                   status=_choice(d, "status", RUN_STATUSES, "ok"), error=_opt_str(d, "error"),
                   seq=_int(d, "seq"), parent=_opt_str(d, "parent"), at=_opt_int(d, "at"))


Record = Call | GradNode | TensorRecord | BackwardRun


# ---- validation helpers (loading must never trust the file) ------------------------------------
# Integers in a trace are counts, sizes, ids and sequence numbers: 0 .. 2**63-1, never a bool
# (JSON's true is Python's 1), a float (Infinity, 1e400) or a 5,000-digit number.
MAX_INT = 2**63 - 1
MAX_DIMS = 256  # far more dimensions than torch allows; bounds what one shape can cost
# Levels of a module path (``h.0.mlp`` has 3). Views walk a path's ancestors (the module tree,
# the DOT fold by depth), which costs the square of its depth: a path of 500,000 levels (1 MB)
# would hang them. Real models nest a few dozen levels (PyTorch's own recursion over submodules
# stops near 1,000).
MAX_MODULE_DEPTH = 256
_HEX = frozenset("0123456789abcdefABCDEF")
_MISSING = object()


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT


def _is_name_list(v: Any) -> bool:
    return isinstance(v, list) and all(x is None or isinstance(x, str) for x in v)


def _require(d: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        raise TraceFormatError(f"{d.get('t', 'record')} record is missing {', '.join(missing)}")


def _str(d: dict[str, Any], key: str, default: Any = _MISSING) -> str:
    v = d[key] if default is _MISSING else d.get(key, default)
    if not isinstance(v, str):
        raise TraceFormatError(f"{d.get('t')} record: {key!r} must be a string, got {type(v).__name__}")
    return v


def _strs(d: dict[str, Any], key: str) -> list[str]:
    v = d.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise TraceFormatError(f"{d.get('t')} record: {key!r} must be a list of strings")
    return list(v)


def _opt_strs(d: dict[str, Any], key: str) -> list[str | None]:
    v = d.get(key, [])
    if not _is_name_list(v):
        raise TraceFormatError(f"{d.get('t')} record: {key!r} must be a list of names (or null)")
    return list(v)


def _path(d: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    """A module path (or a parameter's name, which is one), at most ``MAX_MODULE_DEPTH`` levels
    deep; ``default`` (None) where it may be absent or null."""
    v = _str(d, key) if default is _MISSING else _opt_str(d, key)
    if v is not None and v.count(".") >= MAX_MODULE_DEPTH:
        raise TraceFormatError(f"{d.get('t')} record: {key!r} is a module path of more than {MAX_MODULE_DEPTH} levels")
    return v


def _ints(d: dict[str, Any], key: str) -> list[int]:
    v = d[key]
    if not isinstance(v, list) or len(v) > MAX_DIMS or not all(_is_count(x) for x in v):
        raise TraceFormatError(f"{d.get('t')} record: {key!r} must be a list of at most {MAX_DIMS} "
                               "integers from 0 to 2**63-1")
    return list(v)


# Shapes, strides, dtypes and devices repeat across a trace's records: one object per distinct
# value (a million-tensor trace holds a few hundred), and a shape met before is not checked again
# element by element. Bounded: a file of distinct values empties them now and then.
_DIMS: dict[tuple[Any, ...], tuple[int, ...]] = {}
_SHARED: dict[str, str] = {}
_MAX_SHARED = 8192


def _dims(d: dict[str, Any], key: str) -> tuple[int, ...]:
    """``_ints`` as a tuple, the one object of its value."""
    v = d[key]
    if type(v) is list and len(v) <= MAX_DIMS:
        try:
            known = _DIMS.get(tuple(v))
        except TypeError:  # an unhashable element: _ints says what is wrong
            known = None
        # Equal to a checked shape: the same ints, unless some are JSON's true and false (1, 0).
        if known is not None and (not v or set(map(type, v)) == {int}):
            return known
    dims = tuple(_ints(d, key))
    if len(_DIMS) >= _MAX_SHARED:
        _DIMS.clear()
    return _DIMS.setdefault(dims, dims)


def _shape(d: dict[str, Any], key: str) -> tuple[int, ...]:
    """``_dims`` of a shape, whose element count must be a count too: 256 dimensions of 2**63-1
    are valid integers each, but their product has 4,900 digits, and every report that counts
    elements would fail on it."""
    dims = _dims(d, key)
    if elements(dims) is None:
        raise TraceFormatError(f"{d.get('t')} record: {key!r} holds more than 2**63-1 elements")
    return dims


def elements(shape: tuple[int, ...] | list[int]) -> int | None:
    """The element count of ``shape``, or None where it exceeds 2**63-1 (the product is never
    carried past that: at most one multiplication of two 63-bit numbers)."""
    if 0 in shape:
        return 0
    n = 1
    for s in shape:
        n *= s
        if n > MAX_INT:
            return None
    return n


def _shared(v: str) -> str:
    """The one object of a string value many records hold (a dtype, a device)."""
    if len(_SHARED) >= _MAX_SHARED:
        _SHARED.clear()
    return _SHARED.setdefault(v, v)


def _int(d: dict[str, Any], key: str, default: int = 0) -> int:
    v = d.get(key, default)
    if not _is_count(v):
        raise TraceFormatError(f"{d.get('t')} record: {key!r} must be an integer from 0 to 2**63-1")
    return int(v)


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise TraceFormatError(f"{d.get('t')} record: {key!r} must be true or false")
    return v


def _choice(d: dict[str, Any], key: str, allowed: tuple[Any, ...], default: Any = None) -> Any:
    v = d.get(key, default)
    if not isinstance(v, str) or v not in allowed:
        shown = repr(v) if isinstance(v, str | int | float | bool) or v is None else type(v).__name__
        raise TraceFormatError(f"{d.get('t')} record: {key!r} must be one of {', '.join(allowed)}, got {shown[:80]}")
    return v


def _opt_str(d: dict[str, Any], key: str) -> str | None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise TraceFormatError(f"{d.get('t')} record: {key!r} must be a string or null")
    return v


def _opt_hex(d: dict[str, Any], key: str) -> str | None:
    # A checksum is printed bare (``gradtrace md5``): hex digits only, nothing a terminal acts on.
    v = _opt_str(d, key)
    if v is not None and (len(v) > 128 or not _HEX.issuperset(v)):
        raise TraceFormatError(f"{d.get('t')} record: {key!r} must be hexadecimal digits")
    return v


def _opt_int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not _is_count(v):
        raise TraceFormatError(f"{d.get('t')} record: {key!r} must be an integer from 0 to 2**63-1 or null")
    return int(v)


class MemoryEvent(TypedDict, total=False):
    """One allocation or free of a memory record (``trace(memory=True)``), or a device's
    ``start``/``end`` marker; the fields are documented in docs/trace-format.md."""

    seq: int
    action: Literal["alloc", "free", "start", "end"]
    bytes: int
    device: str
    addr: int | None
    allocated_after: int | None
    reserved_after: int | None
    owner: str | None
    after: bool
    phase: Phase
    tensor: str | None
    source: str  # markers only: "history", "deltas" or "storages"
    requested: int | None  # markers only, CUDA
