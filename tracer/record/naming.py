"""How the recorder names what it sees: API names of the functions the mode meets (qualified,
short, kind, and the arguments each writes), per-trace counters, and the short text of a call's
non-tensor arguments. The name grammar itself (``linear3:out@v1``...) is ``tracer.model.names``."""

from __future__ import annotations

import sys
from typing import Any

import torch

from tracer.record.effects import SET_DATA_API, Writes, op_writes

# Tensor methods and torch functions that only read metadata or convert to Python: never
# recorded (they make no tensor). The general rule in the recorder also drops any call that
# neither returns a tensor nor changes one; this set only saves the cost of checking.
NOISE = frozenset({
    "size", "dim", "numel", "stride", "storage_offset", "is_contiguous", "data_ptr", "element_size",
    "nelement", "ndimension", "__len__", "__repr__", "__format__", "__str__", "__bool__", "__int__",
    "__float__", "__index__", "__complex__", "item", "tolist", "numpy", "__hash__", "__iter__",
    "__array__", "__reduce_ex__", "__deepcopy__", "__setstate__", "__getstate__", "_typed_storage",
    "untyped_storage", "storage", "is_floating_point", "is_complex", "get_device", "has_names",
    "__contains__", "__dlpack__", "__dlpack_device__",
    "register_post_accumulate_grad_hook", "_is_view", "is_set_to", "requires_grad_",
    "is_pinned", "is_shared", "is_signed", "is_inference", "is_nonzero", "__array_wrap__",
    "_make_subclass", "as_subclass", "__torch_function__", "__reversed__", "type", "__dir__",
    "__sizeof__", "_fix_weakref", "is_same_size",
})
# Properties that are real tensor operations (a transpose, a real/imag view) stay recorded;
# every other property read (.shape, .device, ...) is noise but .data and .grad (see _describe).
TENSOR_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
BACKWARD_APIS = frozenset({"Tensor.backward", "torch.autograd.backward", "torch.autograd.grad"})

_MODULE_ALIASES = {
    "torch._C._nn": "torch.nn.functional",
    "torch._C._VariableFunctions": "torch",
    "torch._C._fft": "torch.fft",
    "torch._C._linalg": "torch.linalg",
    "torch._C._special": "torch.special",
    "torch._C._nested": "torch.nested",
    "torch._C._sparse": "torch.sparse",
}
_PREFIXES = {"torch.fft": "fft_", "torch.linalg": "linalg_", "torch.special": "special_"}
_DUNDER_INPLACE = {"iadd": "add_", "isub": "sub_", "imul": "mul_", "itruediv": "div_", "idiv": "div_",
                   "ifloordiv": "floor_divide_", "imod": "remainder_", "ipow": "pow_", "iand": "and_",
                   "ior": "or_", "ixor": "xor_", "ilshift": "lshift_", "irshift": "rshift_",
                   "imatmul": "matmul_"}
_DUNDER_REFLECTED = {"radd": "add", "rsub": "rsub", "rmul": "mul", "rtruediv": "div", "rdiv": "div",
                     "rfloordiv": "floor_divide", "rmod": "remainder", "rpow": "pow", "rmatmul": "matmul",
                     "rand": "and", "ror": "or", "rxor": "xor", "truediv": "div"}

SKIP = ("", "", "skip")


def _describe(func: Any) -> tuple[str, str, str]:
    """(qualified API name, short name for counters, kind) for a function the mode saw.

    kind is ``op``, ``custom_op``, ``collective``, ``backward``, ``hook``, ``retain``,
    ``data_alias``, ``grad_alias``, ``set_data`` or ``skip``.
    """
    # Property access arrives as the descriptor's bound __get__/__set__.
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        prop = getattr(owner, "__name__", "")
        if name == "__get__" and prop in TENSOR_PROPERTIES:
            return f"Tensor.{prop}", prop, "op"
        if name == "__get__" and prop == "data":
            # ``t.data``: a new tensor object on t's bytes with a version counter of its own;
            # it takes t's name (tracer.record.tensor_names.TensorNames.name_data_alias).
            return "Tensor.data", "data", "data_alias"
        if name == "__get__" and prop == "grad":
            # ``p.grad`` read before anything in the block named it (a block that starts after a
            # backward: clipping, a hand-written update): it is named ``<param>@grad``.
            return "Tensor.grad", "grad", "grad_alias"
        if name == "__set__" and prop == "data":
            # ``t.data = v`` (Module.to/.half/.float, vector_to_parameters): ``t`` shows v's
            # bytes from now on while its version counter stays, so no version tells it.
            return SET_DATA_API, "set_data", "set_data"
        return SKIP
    if isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        ns = getattr(func, "namespace", "aten")
        opname = getattr(func, "_opname", name) or name
        full = str(func)
        kind = ("collective" if ns == "_c10d_functional" else
                "op" if ns in ("aten", "prim", "prims", "c10d") else "custom_op")
        return f"torch.ops.{full}", opname, kind
    qual = getattr(func, "__qualname__", name) or name
    module = getattr(func, "__module__", None)
    if (module is None and qual.startswith(("TensorBase.", "Tensor."))) or module == "torch._tensor":
        attr = qual.split(".", 1)[1]
        api = f"Tensor.{attr}"
        if api in BACKWARD_APIS:
            return api, "backward", "backward"
        if attr == "register_hook":  # a backward hook on a tensor: the recorder takes note
            return api, "register_hook", "hook"
        if attr == "retain_grad":  # the .grad the backward will fill is named after the tensor
            return api, "retain_grad", "retain"
        if attr in NOISE:
            return SKIP
        return api, _short(attr), "op"
    if module is None:
        module = "torch"
    module = _MODULE_ALIASES.get(module, module)
    short = name
    prefix = _PREFIXES.get(module)
    if prefix and short.startswith(prefix):
        short = short[len(prefix):]
    api = f"{module}.{short}"
    if api in BACKWARD_APIS:
        return api, "grad" if short == "grad" else "backward", "backward"
    if short in NOISE:
        return SKIP
    # Collectives change tensors in place without bumping versions: the mode hands them to
    # tracer.features.distributed (decided once per function here, not per call).
    return api, _short(short), "collective" if module.startswith("torch.distributed") else "op"


def _short(attr: str) -> str:
    if attr.startswith("__") and attr.endswith("__"):
        core = attr[2:-2]
        if core in _DUNDER_INPLACE:
            return _DUNDER_INPLACE[core]
        return _DUNDER_REFLECTED.get(core, core)
    return attr


Described = tuple[str, str, str, "Writes | None"]


# What every function met so far describes as, for the whole process: a description depends on
# the function alone (its names and its ATen schemas), and each traced step is a new trace, which
# described the same few dozen functions again (their schemas parsed for what they write: ~3% of
# a traced tiny GPT-2 step). Bounded: a program that makes new callables without end (custom ops
# defined in a loop) starts it over.
_DESCRIBED: dict[Any, Described] = {}
_DESCRIBED_MAX = 8192


class ApiNames:
    """Caches, per function object (a dict hit on the hot path): its qualified API name, short
    name and kind (``_describe``), and the arguments it writes (``tracer.record.effects``). The
    cache is the process's (``_DESCRIBED``), shared by every trace."""

    def __init__(self) -> None:
        # Public: the recorder's mode reads it directly on its hot path (a dict hit per call).
        self.cache: dict[Any, Described] = _DESCRIBED

    def describe(self, func: Any) -> Described:
        cache = self.cache
        try:
            hit = cache.get(func)
        except TypeError:  # an unhashable callable
            return _described(func)
        if hit is None:
            hit = _described(func)
            # Not kept: what is ``Tensor.backward`` now (a program may put its wrapper there and
            # take it back), and a method bound to a tensor (the cache never holds a tensor).
            if hit is not _TENSOR_BACKWARD and not isinstance(getattr(func, "__self__", None), torch.Tensor):
                if len(cache) >= _DESCRIBED_MAX:
                    cache.clear()
                cache[func] = hit
        return hit


def tensor_backward(self: torch.Tensor, gradient: Any = None, retain_graph: Any = None, create_graph: bool = False,
                    inputs: Any = None) -> None:
    """What ``Tensor.backward`` does once a mode has the call (torch/_tensor.py). A program may
    replace the class attribute with a wrapper (loss scaling, a counter); torch's own
    ``Tensor.backward`` hands its call to a mode through that attribute, i.e. through the
    wrapper again, which would then run twice (a loss scaled twice): the mode calls this."""
    torch.autograd.backward(self, gradient, retain_graph, create_graph, inputs=inputs)


def tensor_backward_of(func: Any) -> Any:
    """What a mode runs for a ``Tensor.backward`` call it was handed (``func``): torch's own
    ``Tensor.backward`` itself while the class still has it, so that the modes below (a
    program's own ``TorchFunctionMode``) see the call as the program made it; else (a program's
    wrapper in its place) ``tensor_backward``, which does not go through the wrapper again."""
    if func is getattr(torch.Tensor, "backward", None) and getattr(func, "__module__", None) == "torch._tensor":
        return func
    return tensor_backward


_TENSOR_BACKWARD: Described = ("Tensor.backward", "backward", "backward", None)


def _described(func: Any) -> Described:
    if func is getattr(torch.Tensor, "backward", None):  # torch's, or the program's wrapper of it
        return _TENSOR_BACKWARD
    api, short, kind = _describe(func)
    return api, short, kind, (op_writes(func, api) if kind in ("op", "custom_op", "set_data") else None)


class Counters:
    """Per-trace counters: ``next("linear") -> "linear0"``, then ``"linear1"``..."""

    def __init__(self) -> None:
        # short -> [next number, prefix]; the prefix (with its "_" when the short name ends in a
        # digit) is worked out once per short name, not per call.
        self._n: dict[str, list[Any]] = {}

    def next(self, short: str) -> str:
        entry = self._n.get(short)
        if entry is None:
            entry = self._n[short] = [0, f"{short}_" if short[-1:].isdigit() else short]
        n = entry[0]
        entry[0] = n + 1
        return f"{entry[1]}{n}"


def short_args(args: tuple[Any, ...], kwargs: dict[str, Any], limit: int = 120) -> str:
    """A short text of the non-tensor arguments (tensors are listed as inputs by name). The
    same arguments recur call after call (``dim=-1``, a dropout's ``0.1, True, False``, a view's
    sizes): a text is made once per distinct values (``_args_key``) and looked up after that,
    since formatting a float or a one-element tuple costs more than the look-up."""
    key = _args_key(args, kwargs, limit)
    if key is None:
        return _format_args(args, kwargs, limit)
    if key is _NO_VALUES:  # (tensors only: the usual call)
        return ""
    text = _ARGS_TEXT.get(key)
    if text is None:
        text = _format_args(args, kwargs, limit)
        if len(_ARGS_TEXT) >= _ARGS_TEXT_MAX:
            _ARGS_TEXT.clear()
        _ARGS_TEXT[key] = text
    return text


# The texts of the argument values met so far, for the whole process (bounded: a program whose
# arguments never repeat starts it over).
_ARGS_TEXT: dict[tuple[Any, ...], str] = {}
_ARGS_TEXT_MAX = 16384
_KWARGS = object()  # (in a key: a keyword argument's name follows)
_NO_VALUES: tuple[Any, ...] = ()  # the key of arguments that are all tensors


def _args_key(args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> tuple[Any, ...] | None:
    """What ``_format_args`` makes its text of, as a key: each non-tensor value with its type
    (``1``, ``1.0`` and ``True`` are equal keys, not equal texts), a tuple or list of ints as a
    tuple with its type; None when a value is of any other kind, or a float whose text its
    value does not fix (``0.0 == -0.0``; NaN); ``_NO_VALUES`` when all are tensors."""
    key: list[Any] | None = None  # (made at the first value that is not a tensor)
    for a in args:
        if isinstance(a, torch.Tensor):  # (not in the text)
            continue
        if key is None:
            key = [limit]
        if not _keyed(a, key):
            return None
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                continue
            if key is None:
                key = [limit]
            key.append(_KWARGS)
            key.append(k)
            if not _keyed(v, key):
                return None
    return _NO_VALUES if key is None else tuple(key)


# The longest string and int sequence kept in a key: the cache lives as long as the process, and
# a text shows 40 characters or 8 elements of them anyway; a longer one is formatted each time.
_KEY_STR_MAX = 256
_KEY_INTS_MAX = 64


def _keyed(v: Any, key: list[Any]) -> bool:
    """Add ``v`` (its type, its value) to ``key``; False when its text is not fixed by them, or
    when it is too long to keep for the process."""
    t = type(v)
    if t in _SCALAR_TYPES:
        if t is float and (v == 0.0 or v != v):
            return False
        if t is str and len(v) > _KEY_STR_MAX:
            return False
        key.append(t)
        key.append(v)
        return True
    if (t is tuple or t is list) and len(v) <= _KEY_INTS_MAX and all(type(x) is int for x in v):
        key.append(t)
        key.append(tuple(v) if t is list else v)
        return True
    return False


def _format_args(args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> str:
    parts: list[str] = []
    for a in args:
        if isinstance(a, torch.Tensor):  # the common case (parameters too), listed as an input
            continue
        s = _short_value(a)
        if s is not None:
            parts.append(s)
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                continue
            s = _short_value(v)
            if s is not None:
                parts.append(f"{k}={s}")
    if not parts:
        return ""
    text = parts[0] if len(parts) == 1 else ", ".join(parts)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    # Interned: the same few texts ("1", "-1", "dim=-1") repeat on thousands of calls, and one
    # shared string is 50 bytes less per call than a copy each.
    return sys.intern(text)


_SCALARS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
_SCALAR_TYPES = frozenset(_SCALARS)


def _short_value(v: Any, depth: int = 0) -> str | None:
    t = type(v)
    if t in _SCALAR_TYPES:  # the common case, by exact type: no isinstance chain per argument
        r = repr(v)
        return r if len(r) <= 40 else r[:39] + "…"
    if (t is tuple or t is list) and depth <= 1 and 1 < len(v) <= 8 and all(type(x) is int for x in v):
        # A conv's stride, padding, dilation: repr gives the general path's text at a third of its
        # cost (a conv's arguments took 16 µs to format); one element would be "(1,)" there.
        return repr(v)
    if isinstance(v, torch.Tensor):
        return None
    if isinstance(v, _SCALARS):
        return repr(v)[:40]
    if isinstance(v, list | tuple):
        if depth > 1:
            return "…"
        inner = [_short_value(x, depth + 1) for x in v[:8]]
        if all(x is None for x in inner) and v:
            return None  # a list of tensors: they are inputs
        body = ", ".join("T" if x is None else x for x in inner)
        if len(v) > 8:
            body += ", …"
        return f"[{body}]" if isinstance(v, list) else f"({body})"
    if callable(v):
        return getattr(v, "__name__", type(v).__name__)
    if t.__module__ == "numpy" and getattr(v, "ndim", None) == 0:
        # A NumPy scalar (``data[np.int64(i)]``): its value, as for a Python number; the type's
        # name alone hid which row a call read.
        try:
            return repr(v.item())[:40]
        except (AttributeError, TypeError, ValueError):
            pass
    return type(v).__name__
