"""Fuzzing the commands with hostile variants of a real trace (issue 21's acceptance).

A seeded generator makes hundreds of variants of a recorded trace: fields swapped for values of
every other type and range, records cut at boundaries and mid-record, gzip streams cut and
bombed (bombs kept small by a lowered ``--max-decompressed``), cycles, huge ids, deep nesting and
injection payloads; stated sizes and counts (a world of 10**7 ranks, shapes of 4,900-digit element
counts, module paths 300 levels deep, megabyte-long source lines), more traces in a file than the
reader takes (the limit lowered for the run, as the bombs'), required fields left out, and names
with invisible characters (zero-width spaces, TAG characters). Every command that reads a trace runs on each variant in-process; a handful
also as real processes. Each run must end with status 0 or 1, or 2 with exactly one error line;
never a traceback, never gradtrace's "internal error", never a terminal escape or an invisible
character from the file on stdout or stderr, within a time bound; the processes also within a memory bound.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tracer
from export.cli import main
from tests.models import MLP
from tracer.model import fileformat
from tracer.model.display import UNSAFE_RANGES

SEED = 21
N_FIELD_MUTATIONS = 120
SECONDS_PER_RUN = 10.0
SECONDS_PER_PROCESS = 60.0  # a process starts Python and torch on a shared, busy machine
MAX_RSS_BYTES = 1_500_000_000  # a process's peak (torch alone is a few hundred MB)
LOW_LIMIT = "200000"  # bytes: --max-decompressed for every run, so a bomb stays small
LOW_SEGMENTS = 50  # traces in one file for every run, so a file of too many stays small
# What must never reach the terminal from a file, besides the C0 controls checked as such: the
# format and invisible characters gradtrace shows escaped.
SHOWN_ESCAPED = re.compile("[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in UNSAFE_RANGES if a > 0x1F) + "]")

# Values of every kind the format has, and of the ranges it refuses.
HOSTILE_VALUES: list[Any] = [
    None, True, False, -1, 0, 2**63, 10**40, 1.5, float("inf"), float("nan"), "", "x", "[/]",
    "[link=https://evil.example]x[/link]", "\x1b]0;owned\x07\x1b[2J", "a\nforged:00", "\u202egnp.exe",
    "lin\u200bear0", "\ufeff\U000e0041\u061c",
    [], [None], [1, 2], ["a", 3], {}, {"a": [1]}, [[["deep"]]],
]


class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


@pytest.fixture(scope="module")
def seed_lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The lines of a real trace: a model, a custom Function, backward, an optimizer step, a
    memory record and kept values (base64 in the parameters' records), so every command has
    something to show."""
    path = os.fspath(tmp_path_factory.mktemp("fuzz") / "seed.gtrace")
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tracer.trace(out=path, memory=True, keep_values=True):
        Fn.apply(model(torch.randn(3, 8))).pow(2).mean().backward()
        opt.step()
    return Path(path).read_text(encoding="utf-8").splitlines(keepends=True)


def _field_mutations(lines: list[str], rng: random.Random) -> list[tuple[str, bytes]]:
    out = []
    for k in range(N_FIELD_MUTATIONS):
        i = rng.randrange(len(lines))
        rec = json.loads(lines[i])
        key = rng.choice(sorted(rec))
        value = rng.choice(HOSTILE_VALUES)
        if isinstance(rec[key], list) and rec[key] and rng.random() < 0.5:  # an element, not the list
            rec[key][rng.randrange(len(rec[key]))] = value
        else:
            rec[key] = value
        text = "".join(lines[:i]) + json.dumps(rec) + "\n" + "".join(lines[i + 1:])
        out.append((f"field{k}:{rec.get('t')}.{key}", text.encode()))
    return out


def _structure_mutations(lines: list[str]) -> list[tuple[str, bytes]]:
    recs = [json.loads(line) for line in lines]
    calls = [r for r in recs if r["t"] == "call"]
    nodes = [r for r in recs if r["t"] == "node"]
    tensors = [r for r in recs if r["t"] == "tensor"]

    def variant(name: str, edit: Any) -> tuple[str, bytes]:
        copy = json.loads(json.dumps(recs))
        edit(copy)
        return name, "".join(json.dumps(r) + "\n" for r in copy).encode()

    def by_name(rs: list[dict[str, Any]], name: str) -> dict[str, Any]:
        return next(r for r in rs if r.get("name") == name)

    a, b = calls[0]["name"], calls[1]["name"]
    n0, n1 = nodes[0]["name"], nodes[-1]["name"]
    t0 = tensors[0]["name"]
    return [
        variant("call-parent-cycle", lambda rs: (by_name(rs, a).update(parent=b), by_name(rs, b).update(parent=a))),
        variant("call-parent-self", lambda rs: by_name(rs, a).update(parent=a)),
        variant("node-next-cycle", lambda rs: (by_name(rs, n0).update(next=[n1]), by_name(rs, n1).update(next=[n0]))),
        variant("node-parent-cycle", lambda rs: (by_name(rs, n0).update(parent=n1), by_name(rs, n1).update(parent=n0))),
        variant("tensor-previous-self", lambda rs: by_name(rs, t0).update(previous=t0)),
        variant("huge-frame-id", lambda rs: next(r for r in rs if r["t"] == "frame").update(id=10_000_000)),
        variant("huge-stack-id", lambda rs: by_name(rs, a).update(stack=10_000_000)),
        variant("dangling-names", lambda rs: by_name(rs, a).update(inputs=["ghost"], grad_nodes=["ghost"])),
        variant("duplicate-names", lambda rs: by_name(rs, b).update(name=a)),
        variant("deep-meta", lambda rs: rs.insert(1, {"t": "meta", "x": json.loads("[" * 500 + "]" * 500)})),
        variant("second-header", lambda rs: rs.insert(3, dict(rs[0]))),
        variant("unknown-type", lambda rs: rs.insert(2, {"t": "future", "x": 1})),
        variant("no-end", lambda rs: rs.pop()),
        ("deep-nesting", (lines[0] + '{"t":"meta","x":' + "[" * 100_000 + "]" * 100_000 + "}\n").encode()),
        ("huge-int", (lines[0] + '{"t":"meta","x":' + "7" * 5000 + "}\n").encode()),
        ("infinity-seq", (lines[0] + json.dumps({**calls[0], "seq": 0}).replace('"seq": 0', '"seq": Infinity')
                          + "\n").encode()),
        ("lone-surrogate", (lines[0] + json.dumps({**calls[0]}).replace(a, a + "\\udc80") + "\n").encode()),
        ("version-true", lines[0].replace('"version":2', '"version":true').encode()),
        ("binary", bytes(range(256)) * 4),
        ("empty", b""),
        ("not-utf8", lines[0].encode() + b"\xff\xfe\n"),
        # stated sizes and counts: each bounded by what the file holds
        variant("world-size-huge", lambda rs: rs[0].update(distributed={"rank": 0, "world_size": 10**7})),
        variant("rank-beyond-world", lambda rs: rs[0].update(distributed={"rank": 3, "world_size": 2})),
        variant("shape-elements", lambda rs: by_name(rs, t0).update(shape=[2**63 - 1] * 256)),
        variant("shape-product", lambda rs: by_name(rs, t0).update(shape=[2**32, 2**32])),
        variant("shape-zero", lambda rs: by_name(rs, t0).update(shape=[0, 2**63 - 1, 2**63 - 1])),
        variant("module-deep", lambda rs: by_name(rs, a).update(module="a." * 300 + "b")),
        variant("long-strings", lambda rs: (
            [r.update(code="x = " + "a + " * 100_000) for r in rs if r["t"] == "frame"],
            by_name(rs, a).update(args="k=" + "9" * 300_000, module="m" * 300_000))),
        ("segments-too-many", "".join(lines[0] + '{"t":"end"}\n' for _ in range(LOW_SEGMENTS + 1)).encode()),
        ("segments-many", ("".join(lines) * 14).encode()),  # more than a command's note lists
        # required fields
        variant("memory-no-action", lambda rs: [r.pop("action") for r in rs if r["t"] == "memory"]),
        variant("memory-no-allocated-after", lambda rs: [r.pop("allocated_after") for r in rs if r["t"] == "memory"]),
        variant("tensor-no-shape", lambda rs: by_name(rs, t0).pop("shape")),
        # invisible characters in names, consistently renamed
        ("invisible-names", "".join(lines).replace(f'"{a}', f'"{a[:3]}\u200b{a[3:]}').replace(
            f'"{b}', f'"\ufeff{b}\U000e0041\u061c').encode()),
    ]


def _cuts(lines: list[str], rng: random.Random) -> list[tuple[str, bytes]]:
    data = "".join(lines).encode()
    bounds = [len("".join(lines[:i]).encode()) for i in range(1, len(lines))]
    picks = sorted({*rng.sample(bounds, 12), bounds[0], bounds[-1]})
    out = [(f"cut-line{b}", data[:b]) for b in picks]
    out += [(f"cut-mid{b}", data[: b - rng.randrange(1, 40)]) for b in rng.sample(bounds[1:], 8)]
    gz = gzip.compress(data)
    out += [(f"gzip-cut{f}", gz[: int(len(gz) * f)]) for f in (0.05, 0.2, 0.5, 0.8, 0.99)]
    return out


def _bombs(lines: list[str]) -> list[tuple[str, bytes]]:
    pad = json.dumps({"t": "meta", "pad": "x" * 500}) + "\n"
    return [
        ("bomb-many-lines", gzip.compress((lines[0] + pad * 2000).encode(), 9)),  # ~1 MB from a few KB
        ("bomb-one-line", gzip.compress((lines[0] + '{"t":"meta","x":"' + "a" * 1_000_000).encode(), 9)),
        ("bomb-zeros", gzip.compress(b"\0" * 2_000_000, 9)),
    ]


def variants(lines: list[str]) -> list[tuple[str, bytes]]:
    rng = random.Random(SEED)
    return (_field_mutations(lines, rng) + _structure_mutations(lines) + _cuts(lines, rng) + _bombs(lines))


def _argvs(path: str, out_dir: str, good: str, good_rank: str | None = None) -> list[list[str]]:
    """Every command on ``path``; ``diff-ranks`` against ``good_rank`` (the good trace as rank 1 of
    a world of the size the variant states) where given."""
    limit = ["--max-decompressed", LOW_LIMIT]
    return [["summary", path, *limit], ["md5", path, *limit], ["show", path, "linear0", *limit],
            ["dot", path, "-o", os.path.join(out_dir, "g.dot"), *limit],
            ["report", path, "-o", os.path.join(out_dir, "r.html"), *limit],
            ["memory", path, *limit], ["diff", good, path, *limit],
            ["diff-ranks", path, good_rank or good, *limit]]


def _check(argv: list[str], rc: int, out: str, err: str, seconds: float, bound: float = SECONDS_PER_RUN) -> None:
    what = f"{argv[0]} on {argv}"
    assert rc in (0, 1, 2), (what, rc, err)
    assert "Traceback" not in err and "internal error" not in err, (what, err)
    assert "\x1b" not in out and "\x07" not in out, what
    assert not SHOWN_ESCAPED.search(out + err), what
    # Besides the one error line, only warnings and notes of one line each (a truncated file).
    lines = [line for line in err.splitlines() if not line.startswith(("gradtrace: warning: ", "gradtrace: note: "))]
    if rc == 2:
        assert len(lines) == 1 and lines[0].startswith(f"gradtrace {argv[0]}: error: "), (what, err)
    assert seconds < bound, (what, seconds)


def test_every_command_survives_every_hostile_variant(seed_lines, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fileformat, "MAX_SEGMENTS", LOW_SEGMENTS)
    good = os.fspath(tmp_path / "good.gtrace")
    Path(good).write_text("".join(seed_lines), encoding="utf-8")
    header = json.loads(seed_lines[0])
    good_rank = os.fspath(tmp_path / "good_rank.gtrace")  # rank 1 of whatever world the variant states
    Path(good_rank).write_text(json.dumps({**header, "distributed": {"rank": 1}}) + "\n" + "".join(seed_lines[1:]),
                               encoding="utf-8")
    cases = variants(seed_lines)
    assert len(cases) > 150
    refused = 0
    failures = []
    for name, data in cases:
        path = os.fspath(tmp_path / ("v.gtrace.gz" if data[:2] == b"\x1f\x8b" else "v.gtrace"))
        Path(path).write_bytes(data)
        for argv in _argvs(path, os.fspath(tmp_path), good, good_rank):
            start = time.perf_counter()
            rc = main(argv)
            cap = capsys.readouterr()
            try:
                _check(argv, rc, cap.out, cap.err, time.perf_counter() - start)
            except AssertionError as exc:
                failures.append(f"{name}: {argv[0]}: {str(exc)[-300:]}")
            refused += rc == 2
        os.remove(path)
    assert not failures, "\n".join(failures)
    assert refused > len(cases)  # most variants are refused; the rest load with what they hold


@pytest.mark.parametrize("name", ["call-parent-cycle", "bomb-many-lines", "gzip-cut0.5"])
def test_real_processes_stay_within_time_and_memory(seed_lines, tmp_path, name):
    good = os.fspath(tmp_path / "good.gtrace")
    Path(good).write_text("".join(seed_lines), encoding="utf-8")
    data = dict(variants(seed_lines))[name]
    path = os.fspath(tmp_path / ("v.gtrace.gz" if data[:2] == b"\x1f\x8b" else "v.gtrace"))
    Path(path).write_bytes(data)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    argvs = _argvs(path, os.fspath(tmp_path), good)
    for argv in (argvs[0], argvs[3], argvs[6]):  # summary, dot, diff: each a process start with torch
        start = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "tracer", *argv], capture_output=True, text=True, env=env,
                           timeout=120, check=False)
        _check(argv, p.returncode, p.stdout, p.stderr, time.perf_counter() - start, SECONDS_PER_PROCESS)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    assert peak < MAX_RSS_BYTES, peak
