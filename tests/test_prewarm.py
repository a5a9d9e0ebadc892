"""Triton's start-up done early (tracer.record.checksums.prewarm): when it runs, what it does,
and that it never touches a device, never slows a process that cannot use it, and runs on the
importing thread (no import racing the script's own)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tracer.record.checksums import prewarm
from tracer.record.checksums.prewarm import Prewarm, wanted

ROOT = Path(__file__).resolve().parent.parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.fixture
def cuda_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This process looks like one with a CUDA build of torch on a GPU machine (CI has a CPU
    build and no GPU)."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(prewarm, "GPU_DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    for var in ("GRADTRACE_PREWARM", "GRADTRACE_TRITON", "TRITON_INTERPRET"):
        monkeypatch.delenv(var, raising=False)


@needs_triton
def test_wanted_only_with_a_gpu_build_of_torch_and_not_switched_off(cuda_build: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert wanted()
    for var, value in (("GRADTRACE_PREWARM", "0"), ("GRADTRACE_TRITON", "0"), ("TRITON_INTERPRET", "1")):
        monkeypatch.setenv(var, value)
        assert not wanted(), var
        monkeypatch.delenv(var)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert not wanted()  # a CPU-only build: nothing to warm
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert wanted()  # ROCm builds run the Triton kernels too
    monkeypatch.setattr(prewarm, "GPU_DEVICE_FILES", ("/nonexistent/nvidiactl",))
    if sys.platform.startswith("linux"):
        assert not wanted()  # a GPU build on a machine without a GPU driver


def test_nothing_runs_on_a_cpu_only_build() -> None:
    """On a CPU build (CI) importing gradtrace after torch imports no Triton."""
    if torch.version.cuda or getattr(torch.version, "hip", None):
        pytest.skip("a GPU build of torch")
    code = ("import sys, torch, tracer; from tracer.record.checksums.prewarm import PREWARM; "
            "print(PREWARM.done, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]


@needs_triton
def test_prewarm_loads_triton_and_the_kernels_and_fills_tritons_key_cache(cuda_build: None) -> None:
    import triton.runtime.cache as triton_cache  # an optional dependency (skipped above where missing)

    threads = threading.active_count()
    p = Prewarm()
    assert p.run()
    assert not p.run()  # once per process
    assert p.done
    assert threading.active_count() == threads  # on this thread
    assert prewarm.KERNEL_MODULE in sys.modules
    # The steps ran in order, each timed from the start.
    assert list(p.seconds)[:2] == ["kernels", "triton_key"]
    assert p.seconds["kernels"] <= p.seconds["triton_key"]
    key = getattr(triton_cache, "triton_key", None)
    if key is not None and hasattr(key, "cache_info"):
        assert key.cache_info().currsize == 1  # the ~0.4 s hash is done: Triton reuses it
    # What the first compilation would otherwise do inside the first trace's start, done too:
    # the platform key (a ``file`` subprocess) and the kernels' source keys (an ``ast`` walk).
    assert p.seconds["triton_key"] <= p.seconds["platform_key"] <= p.seconds["kernel_keys"]
    import triton.runtime.build as triton_build

    if hasattr(triton_build.platform_key, "cache_info"):
        assert triton_build.platform_key.cache_info().currsize == 1
    knobs = getattr(sys.modules["triton"], "knobs", None)
    if knobs is not None and hasattr(knobs, "NvidiaTool"):  # ptxas found, its version read (Triton >= 3.4)
        assert p.seconds["kernel_keys"] <= p.seconds["ptxas"]
        assert knobs.NvidiaTool.from_path.cache_info().currsize >= 1
    kernels = sys.modules[prewarm.KERNEL_MODULE]
    for name in prewarm.KERNEL_NAMES:
        kernel = getattr(kernels, name)
        assert kernel.hash is not None and not kernel.hash.startswith("recursion:")
    assert not torch.cuda.is_initialized()  # no device touched


@needs_triton
def test_a_failing_step_is_skipped_and_done_is_still_set(cuda_build: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("a Triton without this step")

    monkeypatch.setattr(prewarm, "_triton_key", broken)
    p = Prewarm()
    assert p.run()
    assert p.done
    assert "triton_key" not in p.seconds and "kernels" in p.seconds


@needs_triton
def test_import_after_a_gpu_build_of_torch_prewarms_and_exits_cleanly() -> None:
    """``import tracer`` after a (here pretended) GPU build of torch loads the recording side and
    does the pre-warm before it returns; the process exits with status 0."""
    # (The GPU's device file is pretended too, before gradtrace is imported.)
    code = ("import os, sys, torch; torch.version.cuda = '12.8'; exists = os.path.exists; "
            "os.path.exists = lambda p: p == '/dev/nvidiactl' or exists(p); import tracer; "
            "from tracer.record.checksums.prewarm import PREWARM; "
            "print(PREWARM.done, 'tracer.api' in sys.modules, 'triton' in sys.modules, "
            "torch.cuda.is_initialized())")
    env = {k: v for k, v in os.environ.items() if k not in ("GRADTRACE_PREWARM", "GRADTRACE_TRITON", "TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**env, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "False"]
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**env, "PYTHONPATH": str(ROOT), "GRADTRACE_PREWARM": "0"})
    assert off.stdout.split() == ["False", "True", "False", "False"]


def test_trace_starts_wait_for_the_kernels_at_most_the_budget_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold Triton cache compiles for seconds: the first trace start waits out the budget, the
    ones that follow while it compiles start at once; another set of kernels has its own budget;
    finished kernels cost no wait."""
    import time

    from tracer.record.checksums.launcher import Warmup

    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)  # no GPU: the jobs stand in
    release = threading.Event()
    warmup = Warmup()
    warmup.start(0, [("slow", lambda: release.wait(30)), ("other", lambda: release.wait(30))])

    def timed(keys: list[str], budget: float) -> float:
        start = time.perf_counter()
        warmup.wait_for(keys, budget)
        return time.perf_counter() - start

    try:
        assert 0.2 <= timed(["slow"], 0.25) < 2.0  # the budget, waited out
        assert timed(["slow"], 0.25) < 0.05  # spent: the next start goes on while it compiles
        assert timed(["slow", "other"], 0.25) < 0.05  # a set that includes a spent key: spent
        assert 0.2 <= timed(["other"], 0.25) < 2.0  # its own budget
        assert timed(["unknown"], 0.25) < 0.05  # nothing compiling under that key
    finally:
        release.set()
        warmup.stop()
    assert warmup.ready("slow") and warmup.ready("other")
    assert timed(["slow", "other"], 10.0) < 0.05


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_triton
def test_a_trace_start_does_the_fetchs_first_time_work_while_it_waits_and_never_syncs() -> None:
    """While the first trace start of a process waits for the kernels, it pins the metadata's
    buffers and loads the CUDA kernels of the end's fetch (no sync: the sync debug mode would
    raise); a trace that starts while a CUDA graph is captured launches nothing."""
    code = (
        "import torch, tracer\n"
        "from tracer.record.checksums import fused\n"
        "from tracer.record.checksums.hasher import Hasher\n"
        "torch.zeros(1, device='cuda'); torch.cuda.synchronize()\n"
        "graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()\n"
        "x = torch.ones(4, device='cuda')\n"
        "with torch.cuda.stream(side):\n"
        "    with torch.cuda.graph(graph):\n"
        "        Hasher('none', stats=True).prepare(); y = x * 2\n"
        "print(sorted(fused._FETCH_LOADED))\n"
        "torch.cuda.set_sync_debug_mode('error')\n"
        "h = Hasher('fast', stats=True); h.prepare()\n"
        "torch.cuda.set_sync_debug_mode('default')\n"
        "print(sorted(fused._FETCH_LOADED), bool(h._fused._pinned._buffers))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", f"[{torch.cuda.current_device()}] True"]
