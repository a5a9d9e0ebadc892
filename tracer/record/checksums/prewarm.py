"""Triton's own start-up, done once per process before the first trace needs the kernels.

The first compilation of a process costs ~0.55 s on an H200 host even when Triton's on-disk
cache already holds the kernels, and the batched kernels are compiled when a trace starts: the
tensors of the first traced step take the per-tensor torch path meanwhile (~1.6 ms each). Most
of that time touches no GPU (H200 host, Triton 3.6, warm cache, a fresh process):

- ``import triton``: ~230 ms; the kernel module (``triton_kernels``): ~100 ms;
- ``triton.runtime.cache.triton_key()``: ~370 ms, hashing Triton's own sources and shared
  library (cached per process; hashlib releases the GIL while it hashes);
- the lazy import of ``triton.experimental.gluon`` by the first specialisation: ~130 ms.

After that a specialisation compiles (loads from the cache) in 2-3 ms. So when gradtrace is
imported into a process that has already imported a CUDA (or ROCm) build of torch, or when the
recording side is first loaded, a daemon thread does those steps at once, while the script
builds its model and loads its data. It touches no device (no CUDA context, nothing a fork
would inherit), imports only Triton and the kernel module (which imports only Triton), and
swallows every error: the warm-up at trace start redoes whatever did not happen here.

``GRADTRACE_PREWARM=0`` (or ``GRADTRACE_TRITON=0``) turns it off.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import sys
import threading
import time

# The kernel module: it imports Triton and nothing of torch or of gradtrace.
KERNEL_MODULE = "tracer.record.checksums.triton_kernels"


def wanted() -> bool:
    """Whether this process can use the batched kernels and has not switched the pre-warm off.
    Reads only what is already imported: importing torch here would cost the data-model side
    of ``import tracer`` (which runs without torch) its lightness."""
    if os.environ.get("GRADTRACE_PREWARM", "1") == "0" or os.environ.get("GRADTRACE_TRITON", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the CPU interpreter has no start-up to hide
        return False
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    if version is None or not (getattr(version, "cuda", None) or getattr(version, "hip", None)):
        return False  # torch not imported yet, or a CPU-only build
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


class Prewarm:
    """The one pre-warm of this process: ``start()`` at most once, ``done`` when it is over."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.done = threading.Event()
        self.seconds: dict[str, float] = {}  # per step, from the thread's start (benchmarks read it)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> bool:
        """Start the pre-warm thread if this process wants one and has none yet."""
        with self._lock:
            if self._thread is not None or not wanted():
                return False
            self._thread = threading.Thread(target=self._run, name="gradtrace-triton-prewarm", daemon=True)
        # At exit, wait a little for a thread still running: a script that imports gradtrace
        # and ends at once does not end while the thread loads Triton's native library.
        atexit.register(self.join, 2.0)
        self._thread.start()
        return True

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            for step, action in (("kernels", lambda: importlib.import_module(KERNEL_MODULE)),
                                 ("triton_key", _triton_key),
                                 ("gluon", lambda: importlib.import_module("triton.experimental.gluon"))):
                try:
                    action()
                except Exception:  # an older or newer Triton without this step: the next one
                    continue
                self.seconds[step] = time.perf_counter() - start
        finally:
            self.done.set()

    def join(self, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(timeout)


def _triton_key() -> None:
    cache = importlib.import_module("triton.runtime.cache")
    key = getattr(cache, "triton_key", None)  # (cached by Triton for the process)
    if callable(key):
        key()


PREWARM = Prewarm()
