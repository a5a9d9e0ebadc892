"""Triton's own start-up, done once per process before the first trace needs the kernels.

The first compilation of a process costs ~0.55 s on an H200 host even when Triton's on-disk
cache already holds the kernels, and the batched kernels are compiled when a trace starts: the
tensors of the first traced step took the per-tensor torch path meanwhile (~1.6 ms each). Most
of that time touches no GPU (H200 host, Triton 3.6, warm cache, a fresh process):

- ``import triton``: ~230 ms; the kernel module (``triton_kernels``): ~100 ms;
- ``triton.runtime.cache.triton_key()``: ~370 ms, hashing Triton's own sources and shared
  library (cached by Triton for the process);
- the lazy import of ``triton.experimental.gluon`` by the first specialisation: ~130 ms;
- ``triton.runtime.build.platform_key()``: ~15 ms (``platform.architecture()`` runs ``file`` on
  the interpreter), cached by Triton for the process;
- each kernel's ``cache_key`` (its source and that of the functions it calls, walked with
  ``ast``): ~20 ms for the two, cached on the kernel object.

Those last two were measured inside the first trace start's wait for the kernels (35-60 ms for
the first dtype, 3-5 ms for each further one), and so was finding ptxas (``knobs.nvidia.ptxas``
runs ``ptxas --version``, ~3 ms, cached by Triton per path). After them a specialisation compiles
(loads from the cache) in a few ms; what stays in the first is a second ``ptxas --version``
(~3 ms; Triton caches it per GPU architecture, which only CUDA can tell) and loading Triton's
driver module. So when the recording
side of gradtrace is loaded in a process with a CUDA (or ROCm) build of torch, these steps run
at once, on the importing thread: ``import tracer`` after ``import torch`` costs that much more
(~0.9 s) and the first traced step little more than a later one. Every error is swallowed: the
warm-up at trace start redoes whatever did not happen here. No device is touched (no CUDA
context, nothing a fork would inherit).

Not on a background thread: its imports (``triton_key`` imports Triton's packages as it walks
them) ran concurrently with the script's own, and an ``import triton.runtime.cache`` on the main
thread failed with ``KeyError: 'triton.runtime'`` inside importlib (H200, Python 3.12).

``GRADTRACE_PREWARM=0`` (or ``GRADTRACE_TRITON=0``) turns it off.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable

# The kernel module: it imports Triton and nothing of torch or of gradtrace.
KERNEL_MODULE = "tracer.record.checksums.triton_kernels"
# Its kernels, whose source keys the pre-warm computes.
KERNEL_NAMES = ("partials", "finalize")

# Device files of a GPU driver on Linux (NVIDIA, ROCm, WSL): a CUDA build of torch on a machine
# without a GPU (CI runners, laptops) skips the ~0.9 s. Asking torch instead would initialise
# CUDA (torch.cuda.is_available), which a later fork could not undo.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_present() -> bool:
    """Whether this machine shows a GPU driver's device files (elsewhere than Linux: assumed)."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def triton_switched_off() -> bool:
    """``GRADTRACE_TRITON=0``: the batched kernels are not used (read here and by ``fused``)."""
    return os.environ.get("GRADTRACE_TRITON", "1") == "0"


def wanted() -> bool:
    """Whether this process can use the batched kernels and has not switched the pre-warm off.
    Reads only what is already imported."""
    if os.environ.get("GRADTRACE_PREWARM", "1") == "0" or triton_switched_off():
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the CPU interpreter has no start-up to hide
        return False
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    if version is None or not (getattr(version, "cuda", None) or getattr(version, "hip", None)):
        return False  # torch not imported yet, or a CPU-only build
    if not gpu_present():
        return False
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _triton_key() -> None:
    cache = importlib.import_module("triton.runtime.cache")
    key = getattr(cache, "triton_key", None)  # (cached by Triton for the process)
    if callable(key):
        key()


def _platform_key() -> None:
    build = importlib.import_module("triton.runtime.build")
    key = getattr(build, "platform_key", None)  # (cached by Triton for the process)
    if callable(key):
        key()


def _ptxas() -> None:
    knobs = getattr(importlib.import_module("triton"), "knobs", None)  # (Triton >= 3.4)
    nvidia = getattr(knobs, "nvidia", None)
    if nvidia is not None:
        # Finds ptxas and runs ``ptxas --version`` (cached by Triton per path, for the process).
        getattr(nvidia, "ptxas", None)


def _kernel_source_keys() -> list[str]:
    kernels = sys.modules[KERNEL_MODULE]
    # (A property: computed on first use, then cached on the kernel object.)
    return [getattr(kernels, name).cache_key for name in KERNEL_NAMES]

STEPS: tuple[tuple[str, Callable[[], object]], ...] = (
    ("kernels", lambda: importlib.import_module(KERNEL_MODULE)),
    ("triton_key", lambda: _triton_key()),
    ("gluon", lambda: importlib.import_module("triton.experimental.gluon")),
    ("platform_key", lambda: _platform_key()),
    ("kernel_keys", lambda: _kernel_source_keys()),
    ("ptxas", lambda: _ptxas()),
)


class Prewarm:
    """The one pre-warm of this process: ``run()`` does it at most once; ``done`` once it has."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # two threads loading the recording side at once: one runs it
        self.done = False
        self.seconds: dict[str, float] = {}  # per step, from the start (benchmarks read it)

    def run(self) -> bool:
        """Do the steps now if this process wants them and they have not run; whether they ran."""
        with self._lock:
            if self.done or not wanted():
                return False
            start = time.perf_counter()
            try:
                for step, action in STEPS:
                    try:
                        action()
                    except Exception:  # an older or newer Triton without this step: the next one
                        continue
                    self.seconds[step] = time.perf_counter() - start
            finally:
                self.done = True
        return True


PREWARM = Prewarm()
