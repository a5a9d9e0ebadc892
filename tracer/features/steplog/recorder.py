"""``StepLog``: write a few facts of every optimizer step to a ``.gtsteps`` file, at about the
cost of the step alone (what ``tracer.step_log``, ``tracer.watch(log=...)``, the framework
callbacks and ``gradtrace run --log`` open; the format is ``tracer.model.steplog``).

Per optimizer step, in an optimizer step pre-hook (the moment the optimizer reads the
gradients; with ``step(closure)``, when the closure has computed them): a fingerprint and an L2 norm of every parameter and of every gradient
(``digests``: on the device, batched, no synchronisation), the learning rates and a digest of
the other hyperparameters; with what was gathered since the previous step: the losses (each
``backward()``'s root, from ``tracer.features.backward_ends``), the batch and the random states
(``inputs.ForwardInputs``). On the CPU the record is complete at once and written; on CUDA it
waits in a queue until the device has copied its numbers out (an event, polled at each step;
``MAX_PENDING`` steps at most), then it is written. Each record is one ``write`` of one line to
a file opened for appending: a killed program leaves every step written before the kill.

Steps are counted as ``gradtrace run`` counts them, from 0: one per ``optimizer.step()`` (of the
given optimizer, or of every optimizer when none is given), on the thread that opened the log.
A step replayed by a watch (``paused()``) is not logged twice. A fault in the log's own code
closes the log with a warning; the training goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import platform
import socket
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from tracer.features.backward_ends import BackwardEnds
from tracer.features.distributed import distributed_info, rank_path
from tracer.features.optimizers import real_optimizer
from tracer.features.steplog.digests import ALGORITHM, Digester, Reading, quiet
from tracer.features.steplog.inputs import ForwardInputs, digest, rng_digests
from tracer.model.display import plural
from tracer.model.steplog import Final, Layout, LogParam, StepEntry, encode, header_json
from tracer.options import TraceError
from tracer.record.tensors import dtype_name
from tracer.version import __version__

MAX_PENDING = 8  # steps whose numbers are still on their way from the device
_PAUSED = threading.local()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Optimizer steps taken inside are not logged (a watch's replay of a logged step, the
    repeats of ``check_determinism``)."""
    before = getattr(_PAUSED, "on", False)
    _PAUSED.on = True
    try:
        yield
    finally:
        _PAUSED.on = before


def program_meta() -> dict[str, Any]:
    """The command line of the running program, as ``gradtrace run`` would take it: the script
    (or ``-m`` module) and its arguments."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None) and spec.name != "__main__":
        return {"argv": [spec.name, *sys.argv[1:]], "module": True}
    return {"argv": list(sys.argv), "module": False}


def _meta(source: str, program: dict[str, Any] | None) -> dict[str, Any]:
    return {**(program or program_meta()), "cwd": os.getcwd(), "writer": source, "host": socket.gethostname(),
            "pid": os.getpid(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gradtrace": __version__,
            "torch": torch.__version__, "python": platform.python_version()}


@dataclass
class _OptimizerLayout:
    index: int
    key: tuple[int, ...]
    params: list[torch.Tensor]
    layout: Layout


@dataclass
class _Pending:
    """One step whose device numbers may still be on their way."""

    entry: StepEntry
    tensors: Reading  # the parameters, then their gradients: one reading, one launch per dtype
    n_params: int
    losses: Reading
    batch: list[tuple[list[tuple[str, tuple[int, ...]]], Reading]]  # per outermost call: its tensors' kinds

    def ready(self) -> bool:
        return self.tensors.ready() and self.losses.ready() and all(r.ready() for _, r in self.batch)

    def complete(self) -> StepEntry:
        e = self.entry
        fps, norms = self.tensors.result()
        n = self.n_params
        e.params, e.param_norms, e.grads, e.grad_norms = fps[:n], norms[:n], fps[n:], norms[n:]
        e.loss = [x if x is not None else float("nan") for x in self.losses.result()[1]]
        parts: list[bytes] = []
        for kinds, reading in self.batch:
            for (dtype, shape), fingerprint in zip(kinds, reading.result()[0]):
                parts.append(f"{dtype}{list(shape)}:{fingerprint};".encode())
        e.batch = digest(*parts) if parts else None
        e.batch_tensors = len(parts)
        return e


class StepLog:
    """See the module docstring. ``model``: names the parameters (its module paths; by default
    the modules the first step calls outermost); ``optimizer``: log only its steps (default:
    every optimizer's); ``program``: the command line to store (default: this process's)."""

    def __init__(self, path: str | os.PathLike[str], *, model: torch.nn.Module | None = None,
                 optimizer: Any = None, source: str = "tracer.step_log",
                 program: dict[str, Any] | None = None) -> None:
        if not isinstance(path, str | os.PathLike):
            raise TraceError(f"log must be a path, got {path!r}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TraceError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.path = os.fspath(path)
        self.model = model
        try:
            self.optimizer = real_optimizer(optimizer) if optimizer is not None else None
        except TypeError as exc:
            raise TraceError(f"optimizer: {exc}") from None
        self.source = source
        self.program = program
        self.steps = 0  # optimizer steps logged so far (the next step's number)
        self.written = 0  # of those, written to the file
        self.closed = False  # nothing more is logged
        self.failed: str | None = None
        self._released = False  # hooks removed, file closed
        self._fd: int | None = None
        self._thread = threading.get_ident()
        self._digester = Digester()
        self._layouts: dict[int, _OptimizerLayout] = {}
        self._pending: deque[_Pending] = deque()
        self._hooks: list[Any] = []
        self._backward: BackwardEnds | None = None
        self._inputs: ForwardInputs | None = None
        self._losses: list[torch.Tensor] = []
        self._backwards = 0
        self._batch: list[tuple[list[tuple[str, tuple[int, ...]]], Reading]] = []
        self._rng: dict[str, str] | None = None

    # ---- opening and closing ----------------------------------------------------------------------
    def start(self) -> StepLog:
        """Create the file (replacing one of that name), write its header and start logging."""
        if self._fd is not None or self._released:
            raise TraceError("this step log was started already")
        # One log per rank (run.rank1.gtsteps), also where the log starts before the program sets
        # up its process group (gradtrace run under torchrun: the launcher's environment says).
        where = distributed_info()
        if where is not None and where.get("world_size", 1) > 1:
            self.path = rank_path(self.path, int(where["rank"]))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._write(header_json(ALGORITHM, _meta(self.source, self.program)))
        self._thread = threading.get_ident()
        self._inputs = ForwardInputs(self._on_batch, self._on_first_forward, self._thread)
        self._inputs.install()
        self._backward = BackwardEnds(self._on_backward, self._thread)
        self._backward.install()
        if self.optimizer is not None:
            self._hooks += [self.optimizer.register_step_pre_hook(self._on_optimizer_step),
                            self.optimizer.register_step_post_hook(self._after_optimizer_step)]
        else:
            self._hooks += [register_optimizer_step_pre_hook(self._on_optimizer_step),
                            register_optimizer_step_post_hook(self._after_optimizer_step)]
        _OPEN.add(self)
        return self

    def close(self) -> None:
        """Write the steps still pending, the parameters as they are now and the end record;
        remove the hooks. Waits for the device once."""
        if self._released:
            return
        self._released = self.closed = True
        _OPEN.discard(self)
        self._remove_hooks()
        try:
            if self.failed is None and self._fd is not None:
                self._drain(block=True, every=True)
                for ol in self._layouts.values():
                    fps, norms = self._digester.read(ol.params).result()
                    self._write(Final(ol.index, ol.layout, fps, norms).to_json())
                self._write({"t": "end", "steps": self.steps})
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def flush(self) -> None:
        """Write every step still pending now (on CUDA: waits for their numbers)."""
        if self._fd is not None and not self.closed:
            self._drain(block=True, every=True)

    def __enter__(self) -> StepLog:
        if self._fd is None and not self._released:
            self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._backward is not None:
            self._backward.remove()
            self._backward = None
        if self._inputs is not None:
            self._inputs.remove()
            self._inputs = None

    def _fail(self, exc: BaseException) -> None:
        """The log's own code failed: stop logging (the training goes on), say so once. The
        hooks stay, doing nothing, until ``close()`` (at the latest when the program ends):
        removing an optimizer hook from inside one breaks PyTorch's loop over them."""
        self.failed = f"{type(exc).__name__}: {exc}"
        self.closed = True
        warnings.warn(f"gradtrace: the step log {self.path} stopped after {plural(self.written, 'step')} written: "
                      f"{self.failed}", RuntimeWarning, stacklevel=3)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- what happens between optimizer steps ---------------------------------------------------------
    def _on_backward(self, roots: Sequence[torch.Tensor]) -> None:
        if self.closed or getattr(_PAUSED, "on", False):
            return
        self._backwards += 1
        with quiet():
            self._losses.extend(t.detach().reshape(()) for t in roots if t.numel() == 1)

    def _on_first_forward(self) -> None:
        if self.closed or getattr(_PAUSED, "on", False):
            return
        try:
            self._rng = rng_digests()
        except Exception as exc:
            self._fail(exc)

    def _on_batch(self, tensors: list[torch.Tensor]) -> None:
        if self.closed or getattr(_PAUSED, "on", False):
            return
        try:  # one reading for the call's tensors (on CUDA: one launch pair per dtype)
            kinds = [(dtype_name(t.dtype), tuple(t.shape)) for t in tensors]
            self._batch.append((kinds, self._digester.read(tensors, norms=False, plan="batch")))
        except Exception as exc:
            self._fail(exc)

    # ---- the optimizer step -----------------------------------------------------------------------------
    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if self.closed or getattr(_PAUSED, "on", False) or threading.get_ident() != self._thread:
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if callable(closure):  # the gradients come from the closure, inside step(): log after it
            return self._around_closure(optimizer, args, kwargs, closure)
        self._guarded(optimizer)
        return None

    def _guarded(self, optimizer: Any) -> None:
        try:
            self._log_step(optimizer)
        except Exception as exc:  # the log's fault must not stop the training
            self._fail(exc)

    def _around_closure(self, optimizer: Any, args: Any, kwargs: Any, closure: Any) -> tuple[Any, Any]:
        """``optimizer.step(closure)`` (Lightning's automatic optimization, L-BFGS): the closure
        computes the loss and the gradients inside ``step()``, after the pre-hooks. The step is
        logged when its first call returns (L-BFGS calls it again in its line search: once)."""
        called: list[bool] = []

        def logged_closure() -> Any:
            out = closure()
            if not called:
                called.append(True)
                if not self.closed:
                    self._guarded(optimizer)
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": logged_closure}
        return (args[0], logged_closure, *args[2:]), kwargs

    def _log_step(self, optimizer: torch.optim.Optimizer) -> None:
        ol = self._layout_of(optimizer)
        params = ol.params
        losses = self._losses
        entry = StepEntry(self.steps, ol.index, ol.layout, [], self._backwards,
                          self._inputs.forwards if self._inputs is not None else 0, None, 0,
                          self._rng if self._rng is not None else rng_digests(), *_hyperparameters(optimizer),
                          [], [], [], [])
        tensors = self._digester.read([*params, *[p.grad for p in params]], plan=f"step{ol.index}")
        pending = _Pending(entry, tensors, len(params), self._scalars(losses), self._batch)
        self._pending.append(pending)
        self.steps += 1
        self._reset()
        self._drain(block=len(self._pending) > MAX_PENDING)

    def _reset(self) -> None:
        """What the next step gathers starts from nothing."""
        self._losses, self._backwards, self._batch, self._rng = [], 0, [], None
        if self._inputs is not None:
            self._inputs.reset()

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The step ended: what ran inside it after it was logged (L-BFGS evaluating its closure
        again in a line search) belongs to no later step."""
        if not self.closed and not getattr(_PAUSED, "on", False) and threading.get_ident() == self._thread:
            self._reset()

    def _scalars(self, values: list[torch.Tensor]) -> Reading:
        """The losses' values, exactly (float64 holds every float32, bfloat16 and float16)."""
        if not values:
            return self._digester.read([], norms=True)
        with quiet():
            stacked = torch.stack([v.to(torch.float64) for v in values])
        return _ValuesOf(stacked)

    def _layout_of(self, optimizer: torch.optim.Optimizer) -> _OptimizerLayout:
        key = tuple(map(id, itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)))
        ol = self._layouts.get(id(optimizer))
        if ol is not None and ol.key == key:
            return ol
        index = ol.index if ol is not None else len(self._layouts)
        params, names = _ordered(optimizer, self.model, self._inputs)
        layout = Layout(index, [LogParam(n, tuple(p.shape), dtype_name(p.dtype)) for p, n in zip(params, names)])
        ol = self._layouts[id(optimizer)] = _OptimizerLayout(index, key, params, layout)
        self._write(layout.to_json())
        if self._inputs is not None:
            self._inputs.stop_learning()
        return ol

    # ---- writing --------------------------------------------------------------------------------------
    def _drain(self, block: bool, every: bool = False) -> None:
        """Write the steps whose numbers have arrived, in order (``block``: the oldest at least,
        waiting for it; ``every``: all of them)."""
        while self._pending and (block or every or self._pending[0].ready()):
            self._write(self._pending.popleft().complete().to_json())
            self.written += 1
            block = False

    def _write(self, record: dict[str, Any]) -> None:
        assert self._fd is not None
        data = encode(record)
        while data:  # one write for a whole line, nearly always: a kill leaves whole records
            n = os.write(self._fd, data)
            data = data[n:]


class _ValuesOf(Reading):
    """A reading of one float64 vector's values (the losses): on CUDA copied to pinned memory
    behind an event, as the fingerprints are, and read once it has completed."""

    def __init__(self, vector: torch.Tensor) -> None:
        super().__init__([], [], [])
        self._vector = vector
        self._values: list[float] | None = None
        if vector.device.type != "cuda":
            self._values = vector.tolist()
        else:
            with quiet():
                self._host = torch.empty(vector.shape, dtype=torch.float64, pin_memory=True)
                self._host.copy_(vector, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()

    def ready(self) -> bool:
        return self._values is not None or bool(self._event.query())

    def result(self) -> tuple[list[str | None], list[float | None]]:
        if self._values is None:
            self._event.synchronize()
            self._values = self._host.tolist()
        return [], list(self._values)


def _hyperparameters(optimizer: torch.optim.Optimizer) -> tuple[list[float | None], str]:
    """The learning rate of each param group, and a digest of every other setting of the groups
    (betas, weight decay, momentum, ...). A tensor learning rate (capturable optimizers) stays
    on its device: it is digested, not read."""
    lrs: list[float | None] = []
    others: list[str] = []
    for g in optimizer.param_groups:
        lr = g.get("lr")
        lrs.append(float(lr) if isinstance(lr, int | float) and not isinstance(lr, bool) else None)
        others.append(repr(sorted((k, _setting(v)) for k, v in g.items() if k not in ("params", "lr"))))
        if lrs[-1] is None and lr is not None:
            others.append(f"lr:{_setting(lr)}")
    return lrs, digest(";".join(others).encode())


def _setting(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor{list(v.shape)}{v.dtype}"  # values not read: that would synchronise
    return repr(v)


def _ordered(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None,
             inputs: ForwardInputs | None) -> tuple[list[torch.Tensor], list[str]]:
    """The optimizer's parameters in execution order (the order their modules first ran; the
    rest in the optimizer's order) and their names (module paths from ``model``, else from the
    modules called outermost; ``param_groups.G.I`` where no module holds one)."""
    in_opt: dict[int, torch.Tensor] = {}
    fallback: dict[int, str] = {}
    for gi, g in enumerate(optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            if id(p) not in in_opt:
                in_opt[id(p)] = p
                fallback[id(p)] = f"param_groups.{gi}.{pi}"
    roots = _naming_roots(in_opt, model, inputs)
    names: dict[int, str] = {}
    owner: dict[int, torch.nn.Module] = {}  # parameter -> the module that holds it
    for k, root in enumerate(dict.fromkeys(roots)):
        prefix = "" if k == 0 else type(root).__name__ + "."
        for mod_name, mod in root.named_modules(remove_duplicate=False):
            for p_name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
                if id(p) in in_opt and id(p) not in names:
                    names[id(p)] = prefix + (f"{mod_name}.{p_name}" if mod_name else p_name)
                    owner.setdefault(id(p), mod)
    order: list[torch.Tensor] = []
    seen: set[int] = set()
    modules = list(inputs.order.values()) if inputs is not None else []
    for mod in modules:
        for _, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            if id(p) in in_opt and id(p) not in seen:
                seen.add(id(p))
                order.append(p)
    order += [p for i, p in in_opt.items() if i not in seen]
    return order, [names.get(id(p), fallback[id(p)]) for p in order]


def _naming_roots(in_opt: dict[int, torch.Tensor], model: torch.nn.Module | None,
                  inputs: ForwardInputs | None) -> list[torch.nn.Module]:
    """The modules whose paths name the parameters: the given model first; else the modules
    the first step called outermost and the program's own (``__main__``'s) modules, the one that
    holds the most of the optimizer's parameters first (a script that calls ``model["head"]``
    and indexes ``model["table"].weight`` is named from ``model``)."""
    if model is not None:
        return [model, *(inputs.roots.values() if inputs is not None else ())]
    found = list(inputs.roots.values()) if inputs is not None else []
    main = sys.modules.get("__main__")
    found += [m for m in vars(main).values() if isinstance(m, torch.nn.Module)] if main is not None else []
    unique = list(dict.fromkeys(found))
    held = {id(m): sum(id(p) in in_opt for p in m.parameters()) for m in unique}
    return sorted(unique, key=lambda m: -held[id(m)])


_OPEN: weakref.WeakSet[StepLog] = weakref.WeakSet()


@atexit.register
def _close_open_logs() -> None:
    """A log nobody closed (a script that ends without ``close()``): its pending steps, the final
    parameters and the end record are written when the program ends."""
    for log in list(_OPEN):
        try:
            log.close()
        except Exception as exc:  # at exit there is no caller to raise to
            print(f"gradtrace: the step log {log.path} could not be closed: {exc}", file=sys.stderr)
