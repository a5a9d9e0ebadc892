"""What the recorder reads of tensors and of autograd's engine, each in one place: versions,
storages, views, grad functions, sequence numbers (private torch API, feature-detected here with
its fallback), and the distinct tensors among a call's arguments."""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Mapping
from types import CodeType, FrameType
from typing import Any

import torch

from tracer.record.identity import identity

# Private: autograd's per-thread sequence number (None where missing; see tracer.record.recorder's docstring).
get_seq: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)
# Private: the innermost saved-tensor hooks (None when none are active). Where it is missing,
# hooks are assumed active (every node then gets the pre-hook, as before this mattered).
_top_saved_hooks: Callable[[bool], Any] | None = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
ACCUMULATE = "AccumulateGrad"
# A grad node's kind (its class's name) by its class: ``type(node).__name__`` of a C++ node's
# class makes a new string each time it is read (the name of a class defined in C is decoded from
# its C string at every read), and then hashes it again in every key it is part of. Read as
# ``NODE_KINDS.get(type(node)) or node_kind(node)``: one look-up by the class, the same string.
NODE_KINDS: dict[type, str] = {}


def node_kind(node: Any) -> str:
    """The kind of ``node`` (its class's name), remembered for its class (see NODE_KINDS)."""
    cls = type(node)
    kind = NODE_KINDS.get(cls)
    if kind is None:
        kind = NODE_KINDS[cls] = sys.intern(cls.__name__)
    return kind


DTYPE_NAMES: dict[torch.dtype, str] = {}


# A global forward hook registered with_kwargs=True leaves its id in a private dict of torch's that
# its handle does not clear (torch 2.4-2.13): torch.compile then warns of global hooks for good.
_forward_hooks_with_kwargs: dict[int, bool] | None = getattr(torch.nn.modules.module,
                                                             "_global_forward_hooks_with_kwargs", None)


def remove_global_forward_hook(handle: Any) -> None:
    """Remove a global module forward hook, with what its handle leaves behind."""
    handle.remove()
    if _forward_hooks_with_kwargs is not None:
        _forward_hooks_with_kwargs.pop(handle.id, None)


def dtype_name(dt: torch.dtype) -> str:
    n = DTYPE_NAMES.get(dt)
    if n is None:
        n = DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
    return n


DEVICE_NAMES: dict[torch.device, str] = {}


def device_name(dev: torch.device) -> str:
    # One string per device for the whole process, not a new one per tensor record.
    n = DEVICE_NAMES.get(dev)
    if n is None:
        n = DEVICE_NAMES[dev] = str(dev)
    return n


def version_of(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return 0


RAGGED_NOTE = "not hashed: nested tensor (a size that varies between its components is recorded as 0)"


def plain_sizes(t: torch.Tensor, stride: Any) -> tuple[tuple[int, ...], tuple[int, ...] | None, bool]:
    """Shape and strides of a tensor whose sizes are not all plain ints, as ints: a size that is
    not one number (a nested tensor's ragged dimension) becomes 0. Returns (shape, strides or
    None, whether some size was not one number). Never raises."""
    ragged = False

    def as_int(v: Any) -> int:
        nonlocal ragged
        if type(v) is int:
            return v
        try:
            return int(v)
        except Exception:  # a nested int (jagged) has no value; torch raises several kinds
            ragged = True
            return 0

    try:
        sizes: Any = t.shape
    except RuntimeError:  # a strided nested tensor: its dims are known, not its sizes
        sizes = None
    if sizes is None:
        dims = t.dim()
        shape = []
        for d in range(dims):
            try:
                shape.append(as_int(t.size(d)))
            except RuntimeError:
                ragged = True
                shape.append(0)
        stride = None
    else:
        shape = [as_int(v) for v in sizes]
    plain_stride: tuple[int, ...] | None = None
    if stride is not None and all(type(v) is int for v in stride):
        plain_stride = tuple(stride)  # (strides that depend on a ragged size: none)
    return tuple(shape), plain_stride, ragged or bool(getattr(t, "is_nested", False))


def flat_tensors(obj: Any, out: list[torch.Tensor] | None = None, depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside an argument or result (tuples, lists, dicts, a few levels deep)."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3:
        if isinstance(obj, tuple | list):
            for x in obj:
                if isinstance(x, torch.Tensor):
                    out.append(x)
                elif isinstance(x, tuple | list | dict):
                    flat_tensors(x, out, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                flat_tensors(x, out, depth + 1)
    return out


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (non-reentrant checkpointing, CPU offload) are active: their
    unpack side runs Python inside built-in grad nodes, whose calls need the running node."""
    if _top_saved_hooks is None:
        return True
    try:
        return _top_saved_hooks(False) is not None
    except TypeError:  # another signature: be conservative
        return True


BackwardCFunction = torch.autograd.function.BackwardCFunction


def runs_user_code(node: Any, kind: str) -> bool:
    if kind == ACCUMULATE:
        var = getattr(node, "variable", None)
        return getattr(var, "_post_accumulate_grad_hooks", None) is not None
    return isinstance(node, BackwardCFunction)


def has_backward_hooks(t: torch.Tensor) -> bool:
    """Whether Python hooks were registered on ``t`` with ``register_hook`` (they run in
    backward on the gradient arriving for it)."""
    return bool(getattr(t, "_backward_hooks", None))


def grad_fn_of(t: torch.Tensor) -> Any:
    """``t.grad_fn``, or None where reading it raises (a no_grad view whose base changed)."""
    try:
        return t.grad_fn
    except RuntimeError:
        return None


def creates_graph(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a backward call passes ``create_graph=True`` (by keyword or position)."""
    if "create_graph" in kwargs:
        return bool(kwargs["create_graph"])
    # Positions: Tensor.backward(self, gradient, retain_graph, create_graph),
    # autograd.backward(tensors, grad_tensors, retain_graph, create_graph),
    # autograd.grad(outputs, inputs, grad_outputs, retain_graph, create_graph).
    pos = 4 if api.endswith(".grad") else 3
    return len(args) > pos and bool(args[pos])


# Private: which storage a tensor's bytes live in, by the address of its StorageImpl (what
# ``t.untyped_storage()._cdata`` is). Read without ``untyped_storage()``: a Python storage object,
# once made, lives as long as the storage and holds a reference to it, and autograd sums a
# gradient into another in place only when it holds the last reference to its storage
# (InputBuffer): the program's ``.grad`` then got other version counters under a trace.
_storage_id: Callable[[torch.Tensor], int] | None = getattr(torch._C, "_storage_id", None)


def storage_start(t: torch.Tensor) -> int:
    """The address of the first byte of a non-empty tensor's storage, read off the tensor (no
    storage object is made, see ``_storage_id``); 0 when the storage holds no memory (freed:
    FSDP resizes storages to 0 between uses; a meta tensor)."""
    return int(t.data_ptr()) - int(t.storage_offset()) * t.element_size()


def storage_key(t: torch.Tensor) -> int:
    """Which storage a tensor's bytes live in (0 when it has none that can be read: an empty
    tensor, a freed storage, a wrapper): the storage's identity, not its address, which a later
    allocation may reuse once it is freed (FSDP frees and reallocates parameter storages every
    step). Read with no storage object made (``_storage_id``); the storage object is the
    fallback where that private function is missing."""
    try:
        if _storage_id is not None:
            # (A meta tensor's storage has a size and no memory: it is a storage all the same.)
            return int(_storage_id(t)) if t.numel() and (storage_start(t) or t.is_meta) else 0
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return 0
    key = getattr(s, "_cdata", None)
    if key is None:
        try:
            key = s.data_ptr()
        except (RuntimeError, NotImplementedError):
            return 0
    return int(key) if s.nbytes() else 0


def storage_id(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage alone (one C call), without ``storage_key``'s checks that
    the storage holds memory: what to look a tensor up by in a table keyed by ``storage_key``
    (a hit is confirmed with ``storage_key``). 0 where there is none to read."""
    if _storage_id is None:
        return storage_key(t)
    try:
        return int(_storage_id(t))
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return 0  # (what storage_key says then too)


def indexed_storage_key(t: torch.Tensor, index: Mapping[int, Any]) -> int:
    """``storage_key(t)`` when it is a key of ``index``, else 0. The storage's identity alone
    first (``storage_id``): most tensors asked (an optimizer step writes hundreds, each usually
    alone on its storage) share no indexed storage, and need none of the checks that make an
    identity a key (a non-empty tensor on memory that is there)."""
    if storage_id(t) not in index:
        return 0
    key = storage_key(t)
    return key if key in index else 0


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors show the same bytes the same way (``p`` and ``p.data``)."""
    try:
        return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape \
            and a.stride() == b.stride()
    except (RuntimeError, NotImplementedError, ValueError):  # (ValueError: a lazy module's
        return False  # uninitialised parameter, whose first ``.data =`` materialises it)


def same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` starts at ``a``'s first byte with as many elements of the same dtype, read
    with the same lazy negation and conjugation. For a view that reshapes ``a`` (``view``,
    ``reshape``, ``unsqueeze``...) ``b`` then reads as ``a`` does, in the same order; for one
    that permutes its dimensions (``transpose``...) it holds the same values in another order.
    Tensors with no readable address (wrappers, sparse layouts) never match."""
    try:
        return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.numel() == b.numel() \
            and a.is_neg() == b.is_neg() and a.is_conj() == b.is_conj()
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors read as the same values in the same order, whatever made them: one
    contiguous run of the same bytes (``same_elements``, both contiguous). Their checksums and
    stats are then equal."""
    return same_elements(a, b) and a.is_contiguous() and b.is_contiguous()


def same_multiset(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` holds exactly the values of the contiguous ``a``, maybe in another order,
    whatever made them: the same bytes, with ``b``'s strides a permutation of a contiguous
    layout (``a.t()``, ``a.permute(...)``). Their stats are then equal (the mean up to the order
    of its sum); their checksums, which read the values in order, are not."""
    try:
        if not (same_elements(a, b) and a.is_contiguous()):
            return False
        expected = 1
        for stride, size in sorted(zip(b.stride(), b.shape)):
            if size == 1:  # (any stride)
                continue
            if stride != expected:
                return False
            expected *= size
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


# Views that keep their input's elements in order (a reshape), or reorder them (a permutation of
# the dimensions): torch ops by short name, and the grad nodes that apply them to a gradient
# (class names without their version digits). Their output, where it starts at the input's first
# byte with as many elements, reads as the input (``same_elements``), contiguous or not.
SAME_ORDER = "same order"
REORDERED = "reordered"
VIEW_OPS: dict[str, str] = {
    **dict.fromkeys(("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
                     "detach", "alias"), SAME_ORDER),
    **dict.fromkeys(("t", "T", "mT", "transpose", "permute", "swapaxes", "swapdims", "movedim", "moveaxis"),
                    REORDERED),
}
VIEW_NODES: dict[str, str] = {
    **dict.fromkeys(("ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "SqueezeBackward",
                     "UnsqueezeBackward", "AliasBackward"), SAME_ORDER),
    **dict.fromkeys(("TBackward", "TransposeBackward", "PermuteBackward"), REORDERED),
}


def unique(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of ``ts`` without repeats (by identity), in first-seen order."""
    n = len(ts)
    if n < 2:
        return ts
    if n == 2:
        return ts if ts[0] is not ts[1] else ts[:1]
    if len({identity(t) for t in ts}) == n:  # the usual case: no repeat, keep the list
        return ts
    seen: set[int] = set()
    res = []
    for t in ts:
        key = identity(t)
        if key not in seen:
            seen.add(key)
            res.append(t)
    return res


def first(item: tuple[Any, ...]) -> Any:
    return item[0]


def call_tensors(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """The distinct tensors among a call's arguments (what ``flat_tensors`` finds in both)."""
    ts: list[torch.Tensor] = []
    for a in args:  # flat_tensors(args, ts), its first level inlined: most arguments are flat
        if isinstance(a, torch.Tensor):
            ts.append(a)
        elif isinstance(a, tuple | list | dict):
            flat_tensors(a, ts, 1)
    if kwargs:
        flat_tensors(kwargs, ts)
    return unique(ts)


_VERSION = operator.attrgetter("_version")
GRAD_FN = operator.attrgetter("grad_fn")


def versions_of(ts: list[torch.Tensor]) -> list[int]:
    try:
        return list(map(_VERSION, ts))  # (no comprehension frame: twice per recorded call)
    except RuntimeError:  # an inference tensor among them: ask one by one
        return [version_of(t) for t in ts]


# Private: ``Optimizer.step`` runs as torch's wrapper (``Optimizer.profile_hook_step``), which
# runs the step hooks around the step function held in its closure (the free variable ``func``).
# Where that wrapper is not the one known here (another torch), nothing is found and the step runs
# as it would anyway (see tracer.record.optimizer).
def _step_wrapper_code() -> CodeType | None:
    try:
        wrapper = torch.optim.Optimizer.profile_hook_step(lambda: None)
        code: CodeType = wrapper.__code__
    except Exception:  # another torch: no such wrapper
        return None
    return code if "func" in code.co_freevars else None


_STEP_WRAPPER: CodeType | None = _step_wrapper_code()


def step_function_cell(frame: FrameType, step: Any) -> Any:
    """The closure cell through which ``frame``, a run of torch's optimizer step wrapper, is about
    to call the step function (its hooks before it have run), when ``step`` (the optimizer's
    class's ``step``) is that wrapper and the frame reads that very cell; else None."""
    code = _STEP_WRAPPER
    if code is None or frame.f_code is not code:
        return None
    slot = code.co_freevars.index("func")
    if getattr(step, "__code__", None) is not code:
        return None
    cell = step.__closure__[slot]
    try:
        func = cell.cell_contents
    except ValueError:  # an empty cell
        return None
    return cell if callable(func) and frame.f_locals.get("func") is func else None

