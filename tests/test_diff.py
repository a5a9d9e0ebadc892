"""``export.diff``: the first divergence of two traces, forward and backward, and its outputs.

Every case records two real runs on CPU and checks exact facts: which call is the origin, which
grad node, what was inserted, the exit status of ``gradtrace diff``.
"""

from __future__ import annotations

import io
import json
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console

import tracer
from export.cli import main
from export.diff import DiffError, diff
from export.diff.align import Pair, align, align_steps
from export.diff.page import diff_html, diff_html_text
from tests.browser import opened
from tests.models import hf_model
from tests.test_cli import assert_one_line_error, run


# ---- models --------------------------------------------------------------------------------------
class Attn(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        a = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.h)
        y = a.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, d: int, h: int, extra: str | None = None) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attn(d, h), nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = F.gelu(self.fc(self.ln2(x)))
        if self.extra == "view":      # the model edit: one extra op, values unchanged
            h = h.view(h.shape)
        elif self.extra == "scale":   # the model edit: one extra op that changes values
            h = h * 0.5
        return x + self.out(h)


class Noisy(torch.autograd.Function):
    """Identity forward; backward adds noise from a seed the test picks (nondeterminism on purpose)."""

    seed = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(Noisy.seed)
        return g + 1e-3 * torch.randn(g.shape, generator=gen)


class NoisyForward(torch.autograd.Function):
    """Forward adds seeded noise through an op nested inside the Function."""

    seed = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(NoisyForward.seed)
        return x + torch.randn(x.shape, generator=gen)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g


class Tiny(nn.Module):
    """A 2-layer transformer-ish LM in plain torch."""

    def __init__(self, extra: str | None = None, noisy: type | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.layers = nn.ModuleList([Block(16, 2, extra=extra), Block(16, 2)])
        self.head = nn.Linear(16, 50)
        self.noisy = noisy

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](self.emb(idx))
        if self.noisy is not None:
            x = self.noisy.apply(x)
        return self.head(self.layers[1](x))


def record(*, extra: str | None = None, ulp: bool = False, noisy: type | None = None, optimizer: bool = False,
           autocast: bool = False, hash: str = "md5", stats: bool | None = None) -> tracer.Trace:
    torch.manual_seed(0)
    model = Tiny(extra=extra, noisy=noisy)
    if ulp:  # one ulp up on one element of a layer-1 weight
        with torch.no_grad():
            w = model.layers[1].attn.qkv.weight
            w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(math.inf))
    idx, tgt = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    with tracer.trace(hash=hash, stats=stats) as t:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
        loss.backward()
        if opt is not None:
            opt.step()
    return t


@pytest.fixture(scope="module")
def base() -> tracer.Trace:
    return record()


@pytest.fixture(scope="module")
def ulp() -> tracer.Trace:
    return record(ulp=True)


def _rows(d, status: str) -> list[str | None]:
    return [r.a if r.a is not None else r.b for r in d.rows if r.status == status]


# ---- acceptance ----------------------------------------------------------------------------------
def test_two_seeded_gpt2_runs_are_equal(tmp_path) -> None:
    def run() -> tracer.Trace:
        torch.manual_seed(0)
        model, x = hf_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with tracer.trace() as t:
            model(x, labels=x).loss.backward()
            opt.step()
        return t

    a, b = run(), run()
    r = diff(a, b)
    assert r.equal and r.exit_code == 0
    assert r.forward.compared == len(a.calls) and r.backward.compared == len(a.backward_runs[0].steps)
    assert r.forward.origin is None and r.backward.origin is None
    assert not r.forward.inserted and not r.forward.removed and not r.differing_params
    assert len(r.params) == len([t for t in a.tensors.values() if t.role == "param" and t.previous is None])
    a.save(tmp_path / "a.gtrace")
    b.save(tmp_path / "b.gtrace")
    assert main(["diff", str(tmp_path / "a.gtrace"), str(tmp_path / "b.gtrace")]) == 0


def test_one_ulp_weight_change_origin_is_first_reader(base, ulp) -> None:
    r = diff(base, ulp)
    assert r.exit_code == 1 and not r.equal
    f = r.forward
    readers = [c.name for c in base.calls if "layers.1.attn.qkv.weight" in c.inputs]
    assert readers[0] == "linear4"
    assert (f.origin_a, f.origin_b) == ("linear4", "linear4")
    assert f.origin.module == "layers.1.attn.qkv"
    assert f.reason == "first call to read the changed param layers.1.attn.qkv.weight: input differs, outputs differ"
    assert f.stack_a[-1].code == "q, k, v = self.qkv(x).split(D, dim=-1)"
    assert f.stack_b[-1].code == f.stack_a[-1].code and f.stack_a[-1].file == __file__
    # everything before the origin matches; nothing in layer 0 is contaminated
    before = f.rows[: [r.a for r in f.rows].index("linear4")]
    assert before and all(row.status == "equal" for row in before)
    assert not any(m.startswith("layers.0") for m in f.contaminated)
    assert f.contaminated["layers.1.attn"] > 0 and f.contaminated["head"] == 1
    # only the q third of qkv changed: the k and v views stay equal
    status = {row.a: row.status for row in f.rows}
    assert status["split1"] == "contaminated"
    assert [status[n] for n in ("view3", "view4", "view5")] == ["contaminated", "equal", "equal"]

    b = r.backward
    assert (b.origin_a, b.origin_b) == ("cross_entropy0/LogSoftmaxBackward0",) * 2
    # what differed in that forward call: its input (the logits), not "the call diverged"
    assert b.reason == "forward values saved by cross_entropy0 differ (its input flatten0:out differs)"
    order = base.backward_runs[0].order
    assert order.index("cross_entropy0/LogSoftmaxBackward0") == 1  # right after NllLossBackward0
    assert [row.status for row in b.rows[:1]] == ["equal"]
    assert b.stack_a[-1].code == "loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())"

    changed = {p.name: p for p in r.differing_params}
    assert changed["layers.1.attn.qkv.weight"].value.status == "differ"
    assert all(p.value.status == "equal" for p in r.params if p.name != "layers.1.attn.qkv.weight")
    assert changed["layers.0.fc.weight"].grad.status == "differ"  # contaminated through backward


def test_nondeterministic_backward_found_in_backward_while_forward_matches() -> None:
    Noisy.seed = 1
    a = record(noisy=Noisy, optimizer=True)
    Noisy.seed = 2
    b = record(noisy=Noisy, optimizer=True)
    r = diff(a, b)
    assert r.exit_code == 1
    assert r.forward.equal and r.forward.origin is None and not r.forward.contaminated
    # the optimizer reads the gradients: those calls differ, counted apart
    grad_rows = [row for row in r.forward.rows if row.status == "gradient"]
    assert grad_rows and r.forward.from_backward == {"": len(grad_rows)}
    assert {row.what for row in grad_rows} == {"torch.optim.sgd.SGD.step"}  # the step, one call
    first = r.forward.rows.index(grad_rows[0])
    assert all(row.status == "equal" for row in r.forward.rows[:first])
    assert r.forward.summary().startswith("equal up to backward;")
    # The op inside Noisy's backward() that drew the noise, named with its line.
    assert r.backward.origin_a == "randn0" and a["randn0"].parent == "Noisy0/NoisyBackward"
    # (issue 42: a random op whose inputs match says the RNG state differs, not "outputs differ")
    assert r.backward.reason == ("backward-only: randn0 in the backward of Noisy0/NoisyBackward: random op with "
                                 "equal inputs: the RNG state differs (Noisy0 matched in forward)")
    assert r.backward.stack_a[-1].code == "return g + 1e-3 * torch.randn(g.shape, generator=gen)"
    order = a.backward_runs[0].order
    before = order[: order.index("Noisy0/NoisyBackward")]
    assert all(row.status == "equal" for row in r.backward.rows if row.a in before)
    assert r.backward.contaminated and not any(m.startswith("layers.1") for m in r.backward.contaminated)


def test_nested_function_origin_is_the_inner_call() -> None:
    NoisyForward.seed = 1
    a = record(noisy=NoisyForward)
    NoisyForward.seed = 2
    b = record(noisy=NoisyForward)
    r = diff(a, b)
    inner = [c for c in a.calls if c.parent == "NoisyForward0"]
    assert [c.api for c in inner] == ["torch.randn", "Tensor.add"]
    # the Function starts before the ops inside it, but the difference enters inside
    assert r.forward.origin_a == "randn0"
    assert r.forward.reason == "random op with equal inputs: the RNG state differs"  # (issue 42: was "inputs match, …")
    assert "NoisyForward0" in r.forward.independent


@pytest.mark.parametrize("extra", ["view", "scale"])
def test_inserted_op_is_an_insertion_and_the_rest_aligns(base, extra: str) -> None:
    b = record(extra=extra)
    r = diff(base, b)
    f = r.forward
    assert r.exit_code == 1
    inserted = "view3" if extra == "view" else "mul0"
    assert f.inserted == [inserted] and f.removed == []
    assert f.compared == len(base.calls) == len(b.calls) - 1
    rows = f.rows
    k = next(i for i, row in enumerate(rows) if row.status == "inserted")
    assert rows[k].b == inserted and rows[k].module == "layers.0"
    assert all(row.a is not None and row.b is not None for i, row in enumerate(rows) if i != k)
    assert all(row.status == "equal" for row in rows[:k])
    if extra == "view":
        # names drift (A view3 is B view4) and still align; values after the edit are identical
        pairs = {row.a: row.b for row in rows if row.a is not None}
        assert pairs["view3"] == "view4" and pairs["view5"] == "view6"
        assert all(row.status == "equal" for row in rows[k + 1:])
        assert r.backward.inserted == ["view3/ViewBackward0"] and r.backward.removed == []
        assert r.backward.origin is None and not r.backward.contaminated
        assert f.summary().startswith("1 inserted in B, 0 removed from A; first inserted: view3 "
                                      "(Tensor.view in layers.0); all aligned records equal")
    else:
        after = rows[k + 1]
        assert (after.a, after.b, after.status) == ("linear3", "linear3", "contaminated")
        assert f.origin is None and sum(f.contaminated.values()) > 0
        assert r.backward.inserted == ["mul0/MulBackward0"]


def test_fp32_vs_bf16_autocast_within_tolerance(tmp_path) -> None:
    a = record()
    b = record(autocast=True)
    loose = diff(a, b, rtol=0.05)
    assert loose.exit_code == 0 and loose.equal
    assert loose.verdict().startswith("EQUAL within rtol=0.05 atol=0: largest relative stats difference ")
    # autocast's casts only exist in B: listed apart, not a change of structure
    assert loose.backward.casts and all(n.split("/")[-1].startswith("ToCopyBackward0") for n in loose.backward.casts)
    assert not loose.backward.inserted and not loose.backward.removed
    from export.diff import module_table

    mods = {m["module"]: m for m in module_table(loose)}
    for m in ("layers.0.attn.qkv", "layers.1.fc", "head"):
        assert 0 < mods[m]["max_rel"] < 0.05
    rels = [m["max_rel"] for m in module_table(loose)]
    assert rels == sorted(rels, reverse=True)

    tight = diff(a, b, rtol=1e-3)
    assert tight.exit_code == 1 and tight.forward.origin is not None
    assert tight.forward.reason.startswith("inputs within tolerance, outputs beyond it (rel ")
    assert tight.forward.before_origin is not None and tight.forward.before_origin <= 1e-3
    assert tight.forward.origin.max_rel > 1e-3
    assert tight.verdict().startswith("BEYOND TOLERANCE (rtol=0.001 atol=0), within it (by stats) up to ")

    exact = diff(a, b)
    assert exact.forward.origin_a == "linear0"
    assert exact.forward.reason == "inputs match, outputs differ (dtype float32 vs bfloat16)"

    a.save(tmp_path / "a.gtrace")
    b.save(tmp_path / "b.gtrace")
    assert main(["diff", str(tmp_path / "a.gtrace"), str(tmp_path / "b.gtrace"), "--rtol", "0.05"]) == 0
    assert main(["diff", str(tmp_path / "a.gtrace"), str(tmp_path / "b.gtrace"), "--rtol", "0.001"]) == 1


# ---- bad input: exit 2, one line ---------------------------------------------------------------------
def _one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    return assert_one_line_error(*run(capsys, *argv), argv[0])


def test_mismatched_and_corrupt_inputs_exit_2(tmp_path, capsys, base) -> None:
    good = tmp_path / "good.gtrace"
    base.save(good)
    none = tmp_path / "none.gtrace"
    record(hash="none").save(none)
    line = _one_line_error(capsys, ["diff", str(good), str(none)])
    assert "different hash algorithms (A: md5, B: none)" in line
    line = _one_line_error(capsys, ["diff", str(none), str(none)])
    assert "checksums are unavailable" in line
    fast, old_fast = tmp_path / "fast.gtrace", tmp_path / "old_fast.gtrace"
    trace_fast = record(hash="fast")
    trace_fast.save(fast)
    trace_fast.header["fingerprint"] = "gtfp1-splitmix64x2-128"  # as version 0.1 wrote
    trace_fast.save(old_fast)
    line = _one_line_error(capsys, ["diff", str(fast), str(old_fast)])
    assert "different fingerprint algorithms (A: gtfp2-fmix32x2-64, B: gtfp1-splitmix64x2-128)" in line
    line = _one_line_error(capsys, ["diff", str(none), str(none), "--rtol", "0.1"])
    assert "neither checksums nor stats" in line

    corrupt = tmp_path / "corrupt.gtrace"
    corrupt.write_text("this is not a trace\n")
    assert "not a gradtrace file" in _one_line_error(capsys, ["diff", str(good), str(corrupt)])
    assert "no such file" in _one_line_error(capsys, ["diff", str(good), str(tmp_path / "missing.gtrace")])
    newer = tmp_path / "newer.gtrace"
    text = good.read_text().split("\n", 1)
    head = json.loads(text[0])
    head["version"] = 99
    newer.write_text(json.dumps(head) + "\n" + text[1])
    assert "format version 99" in _one_line_error(capsys, ["diff", str(good), str(newer)])
    assert "rtol must be" in _one_line_error(capsys, ["diff", str(good), str(good), "--rtol", "-1"])

    # two readable traces of different format versions: refused, never "equal"
    other = tracer.load(good)
    other.header["version"] = 0
    with pytest.raises(DiffError, match=rf"format versions differ \(A: {tracer.SCHEMA_VERSION}, B: 0\)"):
        diff(tracer.load(good), other)


def test_hash_none_with_stats_compares_by_stats() -> None:
    a, b = record(hash="none", stats=True), record(hash="none", stats=True)
    r = diff(a, b, atol=0.0)
    assert r.equal and r.verdict() == "EQUAL within rtol=0 atol=0: no difference in the recorded stats"
    c = record(hash="none", stats=True, ulp=True)
    assert diff(a, c, atol=0.0).forward.origin_a == "linear4"


# ---- outputs -----------------------------------------------------------------------------------------
def test_render_verdict_first_then_tables(base, ulp) -> None:
    buf = io.StringIO()
    r = diff(base, ulp)
    r.render(Console(file=buf, width=200, color_system=None))
    lines = buf.getvalue().splitlines()
    # the changed parameter first, its difference labelled as one of stats (no values were kept)
    assert lines[0].startswith("DIVERGED — 1 parameter differs: layers.1.attn.qkv.weight (stats differ: max |Δ| ")
    assert (" | forward: first at linear4 (torch.nn.functional.linear in layers.1.attn.qkv): first call to read "
            "the changed param layers.1.attn.qkv.weight: input differs, outputs differ") in r.verdict()
    text = buf.getvalue()
    assert "Summary" in text and "First forward divergence" in text and "First backward divergence" in text
    assert "q, k, v = self.qkv(x).split(D, dim=-1)" in text
    buf = io.StringIO()
    diff(base, record()).render(Console(file=buf, width=200, color_system=None))
    assert buf.getvalue().splitlines()[0].startswith("EQUAL: ")


def test_cli_json(tmp_path, capsys, base, ulp) -> None:
    base.save(tmp_path / "a.gtrace")
    ulp.save(tmp_path / "b.gtrace")
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a.gtrace"), str(tmp_path / "b.gtrace"), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 1 and data["mode"] == "exact"
    assert data["forward"]["origin"]["a"] == "linear4"
    assert data["forward"]["origin"]["stack_a"][-1]["code"] == "q, k, v = self.qkv(x).split(D, dim=-1)"
    assert data["backward"]["origin"]["a"] == "cross_entropy0/LogSoftmaxBackward0"
    assert data["forward"]["contaminated"]["head"] == 1
    assert [p["name"] for p in data["params"] if p["value"]["status"] == "differ"] == ["layers.1.attn.qkv.weight"]


def _embedded(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="gradtrace-diff">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_html_marks_origin_and_contamination(tmp_path, base, ulp) -> None:
    r = diff(base, ulp)
    page = diff_html_text(r, base, ulp)
    data = _embedded(page)
    fwd, bwd = data["sections"]
    status = {row[0]: row[4] for row in fwd["rows"]}
    assert status["linear4"] == "origin" and status["split1"] == "contaminated" and status["linear3"] == "equal"
    assert [row[4] for row in bwd["rows"]].count("origin") == 1
    g = fwd["graph"]
    names = {n["name"]: n["status"] for n in g["nodes"]}
    assert names["linear4"] == "origin" and names["layers.1.attn.qkv.weight"] == "source"
    assert names["split1"] == "contaminated"
    # self-contained: nothing fetched, no external reference
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|url\((?!#)|@import|fetch\(""", page)
    path = tmp_path / "d.html"
    diff_html(r, base, ulp, path)
    assert path.read_text(encoding="utf-8") == page


def test_cli_html(tmp_path, base, ulp) -> None:
    base.save(tmp_path / "a.gtrace")
    ulp.save(tmp_path / "b.gtrace")
    out = tmp_path / "d.html"
    assert main(["diff", str(tmp_path / "a.gtrace"), str(tmp_path / "b.gtrace"), "--html", str(out)]) == 1
    data = _embedded(out.read_text(encoding="utf-8"))
    origin = data["sections"][0]["origin"]
    assert origin["difference"].startswith("stats differ: max |Δ| ")
    assert origin["difference"].endswith(" (min/max/mean/absmax, not element-wise)")
    del origin["difference"]
    assert origin == {"a": "linear4", "b": "linear4", "module": "layers.1.attn.qkv", "what": "torch.nn.functional.linear"}


EVIL = "</script><img src=x onerror=alert(1)>"


class Scaled(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.k


class Evil(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.add_module(EVIL, Scaled(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, EVIL)(x)


def _evil(k: float) -> tracer.Trace:
    torch.manual_seed(0)
    m, x = Evil(k), torch.randn(2, 4)
    with tracer.trace() as t:
        m(x).sum().backward()
    # plant the same text in every file path of the stacks
    t.frames = [tracer.Frame(f"/{EVIL}/{f.file}", f.line, f.function, f.code) for f in t.frames]
    t.resolve()
    return t


@pytest.mark.browser
def test_html_in_browser_escapes_and_filters(tmp_path) -> None:
    a, b = _evil(1.0), _evil(2.0)
    r = diff(a, b)
    assert r.forward.origin_a == "mul0" and r.forward.origin.module == EVIL
    assert r.forward.stack_a[-1].file.startswith(f"/{EVIL}/")
    path = tmp_path / "evil.html"
    diff_html(r, a, b, path)
    page_text = path.read_text(encoding="utf-8")
    assert EVIL not in page_text  # only escaped inside the JSON
    with opened(path) as (page, errors):
        assert errors == []
        assert page.locator("img").count() == 0
        assert page.locator("#verdict").inner_text().startswith("DIVERGED")
        origin = page.locator("#section-forward tr.origin")
        assert origin.count() == 1 and "mul0" in origin.inner_text()
        assert page.get_by_text(EVIL, exact=True).count() >= 1  # shown as text
        rows = page.locator("#section-forward tbody tr")
        visible = lambda: sum(1 for i in range(rows.count()) if rows.nth(i).is_visible())  # noqa: E731
        before = visible()
        page.locator("#section-forward input[type=checkbox]").check()
        assert visible() < before and visible() == sum(1 for row in r.forward.rows if row.status != "equal")


# ---- alignment -------------------------------------------------------------------------------------
def test_align_survives_insertion_and_removal() -> None:
    a = ["x", "y", "z", "w"]
    b = ["x", "new", "y", "w"]
    assert align(a, b) == [Pair(0, 0), Pair(None, 1), Pair(1, 2), Pair(2, None), Pair(3, 3)]


def test_align_steps_by_translated_name(base) -> None:
    calls = {c.name: c.name.replace("linear", "lin") for c in base.calls}
    a_nodes = ["linear4/AddmmBackward0", "layers.1.attn.qkv.weight/AccumulateGrad", "linear0/TBackward0"]
    b_nodes = ["extra/CastBackward0", "lin4/AddmmBackward0", "lin0/TBackward0",
               "layers.1.attn.qkv.weight/AccumulateGrad"]
    assert align_steps(a_nodes, b_nodes, base, calls) == [
        Pair(None, 0), Pair(0, 1), Pair(1, 3), Pair(2, 2)]
