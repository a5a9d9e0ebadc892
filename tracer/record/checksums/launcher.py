"""Launching the batched Triton kernels at the cost of a torch op, and compiling them before
the first traced step needs them.

``kernel[grid](...)`` (``JITFunction.run``) binds the arguments, builds a specialisation key,
looks it up and checks the kernel's globals on every launch: 30-45 µs of host time on an H200
host, against 6-10 µs for calling the compiled kernel's launcher directly. ``FastLaunch`` keeps
the ``CompiledKernel`` that the first normal launch of a specialisation returned and calls its
launcher from then on. The launcher's calling convention is the same from Triton 3.2 to 3.9
(``run(grid0, grid1, grid2, stream, function, packed_metadata, launch_metadata, enter_hook,
exit_hook, *args)``); which arguments it takes differs (3.2: the non-constexpr ones; 3.3 on: all,
in order), and ``src.signature`` names them. Anything missing, or a launch that raises, turns the
fast path off for good and the normal launch is used (``FastLaunch.usable``).

The caller owns what the bypassed checks guarded: the same constexpr values per cached
launcher (they are in its key), pointers of the same dtypes, each 16-byte aligned (the batch's
buffers are fresh allocations), and integers of the same width.

``Warmup`` compiles the likely specialisations on a daemon thread when a trace starts on a CUDA
machine, so the first traced step does not wait for Triton's compiler (about a second per
specialisation with a cold cache; ~0.5 s per process with a warm one). Until a tensor's
specialisation is ready, ``Fused`` leaves that tensor to the per-tensor torch path.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any

import torch


def _launch_hooks() -> tuple[Any, Any]:
    """Triton's launch hooks (profilers set them), read where the version keeps them. Triton is
    imported by then (the kernels were compiled): read from ``sys.modules``, no import here."""
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    if knobs is not None:  # triton >= 3.4
        return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    compiler = sys.modules.get("triton.compiler")  # 3.2, 3.3: class attributes of CompiledKernel
    kernel = getattr(compiler, "CompiledKernel", None)
    return getattr(kernel, "launch_enter_hook", None), getattr(kernel, "launch_exit_hook", None)


class FastLaunch:
    """One compiled specialisation of a kernel, launched through its launcher."""

    usable = True  # class-wide: one failure and every kernel goes back to the normal launch

    def __init__(self, compiled: Any) -> None:
        compiled._init_handles()  # loads the module on the current device (idempotent)
        names = list(compiled.src.fn.arg_names)
        self._index = [names.index(n) for n in compiled.src.signature]
        self._all = self._index == list(range(len(names)))
        self._compiled = compiled
        self._run = compiled.run
        self._function = compiled.function
        self._packed = compiled.packed_metadata

    def __call__(self, grid: int, stream: int, args: Sequence[Any]) -> None:
        """``args``: every parameter of the kernel in order, constexprs included."""
        if not self._all:
            args = [args[i] for i in self._index]
        enter, leave = _launch_hooks()
        meta = None if enter is None else self._compiled.launch_metadata((grid, 1, 1), stream, *args)
        self._run(grid, 1, 1, stream, self._function, self._packed, meta, enter, leave, *args)


def fast_launcher(compiled: Any) -> FastLaunch | None:
    """A ``FastLaunch`` for what ``kernel[grid](...)`` returned, or None where this Triton's
    compiled kernels do not look as expected (then the normal launch is kept)."""
    if not FastLaunch.usable or compiled is None:
        return None
    if not all(hasattr(compiled, a) for a in ("src", "_init_handles", "launch_metadata", "run")):
        FastLaunch.usable = False
        return None
    try:
        return FastLaunch(compiled)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        FastLaunch.usable = False
        return None


class Warmup:
    """Compiles kernel specialisations on a daemon thread, in the order given; ``ready(key)``
    says whether one is compiled, ``wanted(key)`` whether it is being compiled."""

    def __init__(self) -> None:
        self._futures: dict[Any, Future[Any]] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.seconds: dict[Any, float] = {}  # per key: from the start of its batch to its result
        # Compilations not finished yet: the hot path reads this int first (one attribute read
        # per tensor) and looks keys up only while something is compiling.
        self.compiling = 0
        self._waited: dict[Any, float] = {}  # per key: seconds trace starts have waited for it

    def start(self, device: int, jobs: Sequence[tuple[Any, Callable[[], Any]]]) -> None:
        """Compile ``jobs`` (key, compile function) for CUDA device ``device`` in the background."""
        todo = []
        with self._lock:
            for key, job in jobs:
                if key not in self._futures:
                    self._futures[key] = Future()
                    todo.append((key, job))
            self.compiling += len(todo)
        if todo:
            thread = threading.Thread(target=self._run, args=(device, todo), name="gradtrace-triton-warmup",
                                      daemon=True)
            with self._lock:
                if not self._threads:
                    atexit.register(self.stop)
                self._threads.append(thread)
            thread.start()

    def _run(self, device: int, todo: list[tuple[Any, Callable[[], Any]]]) -> None:
        torch.cuda.set_device(device)  # the current device is per thread; Triton compiles for it
        start = time.perf_counter()
        for key, job in todo:
            future = self._futures[key]
            if self._stopping:  # the process is exiting: what is left is not needed
                future.set_exception(RuntimeError("gradtrace: kernel warm-up stopped at exit"))
            else:
                try:
                    future.set_result(job())
                except BaseException as exc:
                    future.set_exception(exc)
            self.seconds[key] = time.perf_counter() - start
            with self._lock:
                self.compiling -= 1

    def stop(self, timeout: float = 60.0) -> None:
        """At exit: skip the compilations not started and wait for the one running. A daemon
        thread still inside Triton's or torch's C++ code when the interpreter finalises is
        killed there, and the process aborts ("FATAL: exception not rethrown", exit status 134)
        instead of exiting: a script that traced one step and ended while the kernels compiled."""
        self._stopping = True
        with self._lock:
            threads, self._threads = self._threads, []
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def wanted(self, key: Any) -> bool:
        return key in self._futures

    def ready(self, key: Any) -> bool:
        future = self._futures.get(key)
        return future is not None and future.done()

    def wait_all(self, timeout: float | None = None) -> None:
        """Block until every compilation started so far is over (benchmarks: time steady state)."""
        futures_wait(list(self._futures.values()), timeout=timeout)

    def wait_for(self, keys: Sequence[Any], budget: float) -> None:
        """Block until the compilations of ``keys`` are over, for at most ``budget`` seconds over
        the whole process: a cold cache (about a second per kernel) makes the first trace wait
        out the budget, and the traces that follow while it compiles start at once."""
        pending = [(k, f) for k in keys if (f := self._futures.get(k)) is not None and not f.done()]
        if not pending:
            return
        with self._lock:
            left = budget - max(self._waited.get(k, 0.0) for k, _ in pending)
        if left <= 0:
            return
        start = time.perf_counter()
        futures_wait([f for _, f in pending], timeout=left)
        spent = time.perf_counter() - start
        with self._lock:
            for k, _ in pending:
                self._waited[k] = self._waited.get(k, 0.0) + spent

    def result(self, key: Any) -> Any:
        """The compiled kernel (None if the warm-up failed: the normal launch compiles it)."""
        future = self._futures.get(key)
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()


WARMUP = Warmup()  # one per process: compiled kernels are per process too
