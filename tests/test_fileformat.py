"""The trace file: streamed, versioned, loaded without executing anything, refused when bad."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import torch

import tracer
from tests.models import MLP
from tracer.model import SCHEMA_VERSION


def _record(path: str | None = None, **kw) -> tracer.Trace:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(out=path, **kw) as t:
        model(torch.randn(3, 8)).pow(2).mean().backward()
        opt.step()
    return t


def test_save_load_equal(tmp_path):
    t = _record()
    for name in ("a.gtrace", "a.gtrace.gz"):
        p = os.fspath(tmp_path / name)
        t.save(p)
        loaded = tracer.load(p)
        assert list(loaded.records()) == list(t.records())
        assert loaded["linear1"].stack == t["linear1"].stack
        assert loaded.backward_runs[0].order == t.backward_runs[0].order
    with gzip.open(tmp_path / "a.gtrace.gz", "rt") as fh:
        assert json.loads(fh.readline())["format"] == "gradtrace"


def test_streamed_file_equals_saved_file(tmp_trace, tmp_path):
    t = _record(tmp_trace, flush_every=4)
    streamed = tracer.load(tmp_trace)
    assert list(streamed.records()) == list(t.records())


def test_truncated_file_loads_what_was_written_with_a_warning(tmp_trace, tmp_path):
    t = _record()
    t.save(tmp_trace)
    with open(tmp_trace) as fh:
        lines = fh.read().splitlines(keepends=True)
    cut = os.fspath(tmp_path / "cut.gtrace")
    keep = len(lines) * 2 // 3
    with open(cut, "w") as fh:
        fh.writelines(lines[:keep])
        fh.write(lines[keep][: len(lines[keep]) // 2])  # a record cut mid-line, as a crash leaves it
    with pytest.warns(tracer.TruncatedTraceWarning, match="cut off"):
        loaded = tracer.load(cut)
    assert loaded.status == "truncated"
    assert 0 < len(loaded.tensors) <= len(t.tensors)


@pytest.mark.parametrize("content, message", [
    ("", "empty file"),
    ("hello world\n", "not a gradtrace file"),
    ('{"t": "header", "format": "other", "version": 1}\n', "not a gradtrace file"),
    ('{"t": "header", "format": "gradtrace", "version": 99}\n',
     f"trace format version 99 is newer than this gradtrace reads \\(version {SCHEMA_VERSION}\\)"),
    ('{"t": "header", "format": "gradtrace", "version": 1}\n{"t": "call", "name": 3}\n{"t": "end"}\n',
     "line 2: call record is missing api"),
    ('{"t": "header", "format": "gradtrace", "version": 1}\n{not json\n{"t": "end"}\n', "corrupt record at line 2"),
    ('{"t": "header", "format": "gradtrace", "version": 1}\n[1, 2]\n', "not a typed JSON object"),
])
def test_bad_files_are_refused_in_one_line(tmp_path, content, message):
    p = tmp_path / "bad.gtrace"
    p.write_text(content)
    with pytest.raises(tracer.TraceFormatError, match=message) as info:
        tracer.load(p)
    assert "\n" not in str(info.value)


def test_binary_and_pickle_files_are_refused_not_executed(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + os.fspath(tmp_path / "pwned"),))

    p = tmp_path / "evil.gtrace"
    p.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(tracer.TraceFormatError):
        tracer.load(p)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(tracer.TraceFormatError, match="no such file"):
        tracer.load(tmp_path / "missing.gtrace")


def test_meta_holds_host_and_paths_header_holds_settings():
    t = _record()
    assert {"host", "pid", "cwd", "argv", "started", "seconds"} <= set(t.meta)
    assert t.header["hash"] == "md5" and t.header["stacks"] is True
    assert t.header["torch"] == torch.__version__
    assert not any(os.getcwd() in json.dumps(v) for k, v in t.header.items())


def test_streamed_trace_keeps_memory_records(tmp_trace):
    with tracer.trace(hash="none", memory=True, out=tmp_trace) as t:
        y = torch.ones(1000) * 2
    assert t.memory and tracer.load(tmp_trace).memory == t.memory
    del y
