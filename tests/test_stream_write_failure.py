"""A streamed trace whose file cannot be written any more (a full disk, a quota, a file-size
limit) stops recording with a warning; the program goes on to the same result, untraced from
there. The file keeps what reached it, the trace in memory what was recorded, and the output is
given back (no lock left beside it), so the next block can write it."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import tracer
from tracer.model import writer as writer_module

STOPPED = "gradtrace: recording stopped: writing the trace to"


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(4)],
                            torch.nn.Linear(16, 1))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2), torch.randn(8, 16)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fail_writes_after(monkeypatch: pytest.MonkeyPatch, n: int) -> list[int]:
    """StreamWriter.write succeeds ``n`` times, then raises ENOSPC as a full disk would."""
    calls = [0]
    real = writer_module.StreamWriter.write

    def write(self: Any, records: list[dict[str, Any]]) -> None:
        calls[0] += 1
        if calls[0] > n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, records)

    monkeypatch.setattr(writer_module.StreamWriter, "write", write)
    return calls


def _stopped_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith(STOPPED)]


def test_a_full_disk_mid_block_stops_recording_and_the_program_goes_on(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    m, opt, x = _model()
    untraced = _train(m, opt, x, 5)
    m, opt, x = _model()
    out = os.fspath(tmp_path / "full.gtrace")
    _fail_writes_after(monkeypatch, 3)  # the header, then two flushes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer.trace(out=out, flush_every=8) as t:
            traced = _train(m, opt, x, 5)
    assert traced == untraced  # every step ran, to the same losses
    stopped = _stopped_warnings(caught)
    assert len(stopped) == 1
    assert f"writing the trace to {out} failed (OSError: {os.strerror(errno.ENOSPC)})" in stopped[0]
    assert t.status == "ok"  # the program did not fail: gradtrace stopped
    assert any(n.startswith("recording stopped: writing the trace to") for n in t.notes)
    assert 8 <= len(t.calls) < 5 * 30  # recorded up to the failure, none after it
    assert not os.path.exists(out + ".lock")
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="ends before its end record"):
        on_disk = tracer.load(out)
    # What reached the file is the start of what the trace in memory holds.
    assert 0 < len(on_disk.calls) < len(t.calls)
    assert [c.name for c in on_disk.calls] == [c.name for c in t.calls[:len(on_disk.calls)]]
    # The output was given back: the next block writes it afresh.
    with tracer.trace(out=out) as again:
        _train(m, opt, x, 1)
    assert [c.name for c in tracer.load(out).calls] == [c.name for c in again.calls]


def test_a_full_disk_at_the_blocks_end_keeps_the_trace_in_memory_whole(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    m, opt, x = _model()
    with tracer.trace() as whole:
        _train(m, opt, x, 2)
    m, opt, x = _model()
    out = os.fspath(tmp_path / "end.gtrace")
    real = writer_module.StreamWriter.write

    def write(self: Any, records: list[dict[str, Any]]) -> None:
        if any(r.get("t") == "end" for r in records):  # the block's last write: the disk is full now
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, records)

    monkeypatch.setattr(writer_module.StreamWriter, "write", write)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer.trace(out=out) as t:
            _train(m, opt, x, 2)
    assert len(_stopped_warnings(caught)) == 1
    assert any(n.startswith("recording stopped: writing the trace to") for n in t.notes)
    assert t.status == "ok"
    assert [c.name for c in t.calls] == [c.name for c in whole.calls]
    assert [r.md5 for r in t.tensors.values()] == [r.md5 for r in whole.tensors.values()]
    assert not os.path.exists(out + ".lock")


_LIMITED = textwrap.dedent("""
    import resource, signal, sys, warnings
    import torch
    import tracer
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer.trace(out=sys.argv[1]) as t:
            for _ in range(20):
                m(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    print("losses", m(x).pow(2).mean().item())
    print("stopped", sum(str(w.message).startswith("gradtrace: recording stopped: writing the trace") for w in caught))
""")


@pytest.mark.parametrize("suffix", [".gtrace", ".gtrace.gz"])
def test_a_file_size_limit_of_the_operating_system_stops_recording_not_the_program(
        tmp_path: Path, suffix: str) -> None:
    """The real error of a real limit (EFBIG), plain and gzip (whose close writes a trailer)."""
    script = tmp_path / "limited.py"
    script.write_text(_LIMITED)
    out = os.fspath(tmp_path / f"limited{suffix}")
    proc = subprocess.run([sys.executable, os.fspath(script), out], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "stopped 1" in proc.stdout
    assert not os.path.exists(out + ".lock")
    assert os.path.getsize(out) <= 20_000
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a trace cut short says so)
        on_disk = tracer.load(out)  # what reached the file before the limit, readable
    assert on_disk.status == "truncated" and on_disk.tensors
