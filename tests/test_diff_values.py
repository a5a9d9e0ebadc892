"""Honest diffs (issue 20): kept tensor values and element-wise differences, stat differences
labelled as such, changed parameters named first, and traces of two different programs."""

from __future__ import annotations

import base64
import gzip
import io
import json

import pytest
import torch
import torch.nn as nn
from rich.console import Console

import tracer
from export.cli import main
from export.diff import diff, diff_html, diff_payload
from export.diff.elements import ONLY_STATS, element_diff
from tests.models import SmallCNN, hf_model
from tests.test_cli import assert_one_line_error, run
from tracer.model import TraceFormatError
from tracer.options import TraceError

DELTA = 3.1e-4
WEIGHT = "transformer.h.1.mlp.c_fc.weight"


def _gpt2_step(delta: float, keep: object) -> tuple[tracer.Trace, torch.Tensor]:
    """One SGD step of a tiny GPT-2; ``delta`` added to one element of one weight first. Returns
    the trace and that weight as it was before the step."""
    torch.manual_seed(0)
    model, x = hf_model("gpt2")
    w = model.get_parameter(WEIGHT)
    if delta:
        with torch.no_grad():
            w[3, 5] += delta
    before = w.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(keep_values=keep) as t:  # type: ignore[arg-type]
        model(x, labels=x).loss.backward()
        opt.step()
    return t, before


@pytest.fixture(scope="module")
def kept() -> tuple[tracer.Trace, tracer.Trace, torch.Tensor, torch.Tensor]:
    (a, wa), (b, wb) = _gpt2_step(0.0, ["transformer.h.1.*"]), _gpt2_step(DELTA, ["transformer.h.1.*"])
    return a, b, wa, wb


@pytest.fixture(scope="module")
def plain() -> tuple[tracer.Trace, tracer.Trace]:
    return _gpt2_step(0.0, False)[0], _gpt2_step(DELTA, False)[0]


def _text(result) -> str:
    buf = io.StringIO()
    result.render(Console(file=buf, width=400, color_system=None))
    return buf.getvalue()


# ---- element-wise where values were kept ---------------------------------------------------------
def test_perturbed_weight_shows_the_exact_elementwise_difference(kept, tmp_path, capsys) -> None:
    a, b, wa, wb = kept
    r = diff(a, b)
    value = {p.name: p for p in r.params}[WEIGHT].value
    truth = (wb.double() - wa.double()).abs()
    assert value.status == "differ" and value.basis == "values"
    assert value.abs == truth.max().item()  # exact: computed in float64 from the kept bytes
    assert value.abs == pytest.approx(DELTA, rel=1e-3)
    assert value.rel == (truth / torch.maximum(wa.abs(), wb.abs()).double()).max().item()
    assert value.elements is not None
    assert (value.elements.differing, value.elements.total, value.elements.first) == (1, wa.numel(), (3, 5))
    assert r.verdict().startswith(f"DIVERGED — 1 parameter differs: {WEIGHT} (element-wise: max abs 0.00031")
    assert "1 of 4096 elements differ, first at [3, 5]" in r.verdict()
    assert ONLY_STATS not in r.notes
    # the first call that reads it is in a module whose outputs were kept too: element-wise there
    o = r.forward.origin
    assert o is not None and o.module == "transformer.h.1.mlp.c_fc" and o.basis == "values"
    assert o.describe().startswith("element-wise: max abs ") and "stats" not in repr(o)
    # the same through the files and the command line
    a.save(tmp_path / "a.gtrace")
    b.save(tmp_path / "b.gtrace")
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a.gtrace"), str(tmp_path / "b.gtrace"), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    first = data["params"][0]
    assert first["name"] == WEIGHT and first["value"]["basis"] == "values"
    assert first["value"]["max_abs"] == truth.max().item()
    assert first["value"]["elements"] == {"total": 4096, "differing": 1, "first": [3, 5],
                                          "max_abs": truth.max().item(), "max_rel": value.rel, "beyond": 1}
    assert main(["diff", str(tmp_path / "a.gtrace"), str(tmp_path / "b.gtrace")]) == 1
    out = capsys.readouterr().out
    assert "element-wise: max abs 0.00031" in out and "only checksums and stats" not in out


def test_without_kept_values_the_difference_is_labelled_a_stats_difference(plain, tmp_path) -> None:
    a, b = plain
    r = diff(a, b)
    value = {p.name: p for p in r.params}[WEIGHT].value
    assert value.status == "differ" and value.basis == "stats" and value.elements is None
    assert value.abs is not None and value.abs < DELTA / 100  # why the label matters: far below the change
    label = value.describe()
    assert label.startswith("stats differ: max |Δ| ") and label.endswith("(min/max/mean/absmax, not element-wise)")
    assert r.verdict().startswith(f"DIVERGED — 1 parameter differs: {WEIGHT} (stats differ: max |Δ| ")
    assert r.notes[0] == ONLY_STATS
    text = _text(r)
    assert "note: only checksums and stats are known: no tensor values were kept" in text
    assert "stats differ: max |Δ|" in text and "element-wise:" not in text
    o = r.forward.origin
    assert o is not None and o.basis == "stats" and ", stats max |Δ| " in repr(o) and "max abs" not in repr(o)
    data = r.to_json()
    assert data["params"][0]["value"]["basis"] == "stats"
    assert data["forward"]["origin"]["difference"].startswith("stats differ: ")
    assert data["notes"][0] == ONLY_STATS
    page = diff_payload(r, a, b)
    assert page["sections"][0]["origin"]["difference"].startswith("stats differ: ")
    assert page["notes"][0] == ONLY_STATS
    assert ONLY_STATS[:40] in r._repr_html_()


def test_values_kept_on_one_side_only_are_said(kept, plain) -> None:
    r = diff(kept[0], plain[1])
    assert r.notes[0].startswith("tensor values were kept in A only: element-wise differences need them in B")
    assert {p.name: p for p in r.params}[WEIGHT].value.basis == "stats"


def test_elementwise_difference_matches_torch_for_every_dtype() -> None:
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                  torch.uint8, torch.complex64):
        a = (torch.randn(5, 7) * 50).to(dtype) if not dtype.is_complex else torch.randn(5, 7, dtype=dtype)
        b = a.clone()
        b[2, 3] += 1
        b[4, 6] += 3
        raw = [x.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for x in (a, b)]
        name = str(dtype).removeprefix("torch.")
        e = element_diff(raw[0], raw[1], name, (5, 7))
        parts = torch.view_as_real(a) if dtype.is_complex else a
        parts_b = torch.view_as_real(b) if dtype.is_complex else b
        truth = (parts_b.double() - parts.double()).abs()
        assert e.max_abs == truth.max().item(), dtype
        assert e.differing == int((truth != 0).sum()) and e.first == (2, 3), dtype
    nan, inf = float("nan"), float("inf")
    a, b = torch.tensor([1.0, nan, 2.0, inf]), torch.tensor([1.0, nan, 2.5, 3.0])
    e = element_diff(a.numpy().tobytes(), b.numpy().tobytes(), "float32", (4,), rtol=10.0)
    assert (e.differing, e.first, e.max_abs, e.beyond) == (2, (2,), inf, 1)  # NaN vs NaN is equal


# ---- keeping values --------------------------------------------------------------------------------
def test_kept_values_round_trip_exactly(kept, tmp_path) -> None:
    a, _, wa, _ = kept
    assert a.tensors[WEIGHT].values == wa.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    chosen = {n for n, r in a.tensors.items() if r.values is not None}
    assert WEIGHT in chosen and f"{WEIGHT}@grad" in chosen and f"{WEIGHT}@v1" in chosen
    assert all(n.startswith("transformer.h.1.") or a.tensors[n].role == "output" for n in chosen)
    assert not any(n.startswith("transformer.h.0.") for n in chosen)
    for path in (tmp_path / "a.gtrace", tmp_path / "a.gtrace.gz"):
        a.save(path)
        back = tracer.load(path)
        assert {n: r.values for n, r in back.tensors.items()} == {n: r.values for n, r in a.tensors.items()}
    assert a.header["keep_values"] == {"patterns": ["transformer.h.1.*"], "max_bytes": 64 << 20}


def test_streamed_trace_keeps_the_values_it_recorded(tmp_path) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x = torch.randn(5, 4)
    path = tmp_path / "s.gtrace"
    with tracer.trace(keep_values=True, out=path, flush_every=1) as t:
        m(x).sum().backward()
        with torch.no_grad():
            m[0].weight.mul_(2)  # a new version of a kept parameter, recorded after the flushes
    back = tracer.load(path)
    kept = {n: r.values for n, r in back.tensors.items() if r.values is not None}
    assert kept == {n: r.values for n, r in t.tensors.items() if r.values is not None}
    assert set(kept) == {"0.weight", "0.bias", "2.weight", "2.bias", "0.weight@v1"}
    w = torch.frombuffer(bytearray(kept["0.weight@v1"]), dtype=torch.float32).view(3, 4)
    assert torch.equal(w, m[0].weight.detach())
    assert torch.equal(torch.frombuffer(bytearray(kept["0.weight"]), dtype=torch.float32).view(3, 4) * 2, w)


def test_patterns_match_tensor_names_and_module_paths() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with tracer.trace(keep_values=["0.*", "*@grad"]) as t:
        m(torch.randn(5, 4)).sum().backward()
    kept = {n for n, r in t.tensors.items() if r.values is not None}
    grads = {n for n, r in t.tensors.items() if n.endswith("@grad")}
    # "0.*": the parameters of module 0 by name, and the output of its call by module path
    assert kept == {"0.weight", "0.bias", "linear0:out"} | grads
    assert t.notes == [f"values kept of {len(kept)} tensors matching keep_values "
                       f"({sum(len(t.tensors[n].values or b'') for n in kept)} bytes of 64.0 MiB)"]
    with tracer.trace() as t:
        m(torch.randn(5, 4)).sum()
    assert all(r.values is None for r in t.tensors.values()) and "keep_values" not in t.header and not t.notes
    with pytest.raises(TraceError, match="keep_values must be True"):
        tracer.trace(keep_values=[3])  # type: ignore[list-item]
    with pytest.raises(TraceError, match="keep_values_bytes must be a positive integer"):
        tracer.trace(keep_values=True, keep_values_bytes=0)


def test_byte_cap_is_a_note_never_silent(tmp_path) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))  # 48 + 12 + 24 + 8 bytes
    with tracer.trace(keep_values=True, keep_values_bytes=64) as t:
        m(torch.randn(5, 4)).sum().backward()
    assert {n for n, r in t.tensors.items() if r.values is not None} == {"0.weight", "0.bias"}
    assert t.notes == ["values kept of 2 parameters and buffers (60 bytes of 64 bytes)",
                       "values of 2 parameters and buffers beyond the 64 bytes cap (raise keep_values_bytes); "
                       "the first: 2.weight"]
    t.save(tmp_path / "t.gtrace")
    assert tracer.load(tmp_path / "t.gtrace").notes == t.notes


# ---- hostile files ---------------------------------------------------------------------------------
def _one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    return assert_one_line_error(*run(capsys, *argv), argv[0])


def test_hostile_values_are_refused_with_one_line(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3))
    with tracer.trace(keep_values=True) as t:
        m(torch.randn(2, 4))
    good = tmp_path / "good.gtrace"
    t.save(good)
    lines = good.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"name":"0.weight"' in line and '"values"' in line)
    rec = json.loads(lines[at])
    text = rec["values"]
    cases = {
        "short": (dict(values=text[:-4]), "'values' holds 60 base64 characters, but float32 [3, 4] needs 48 bytes"),
        "bad base64": (dict(values="!" * len(text)), "'values' is not valid base64"),
        "not text": (dict(values=12), "'values' must be base64 text, got int"),
        "shape": (dict(shape=[3, 5]), "needs 60 bytes"),
        "dtype": (dict(dtype="float64"), "needs 96 bytes"),
        "no size": (dict(dtype="qint8"), "'values' of dtype 'qint8' cannot be checked"),
        "huge shape": (dict(shape=[1 << 40, 1 << 20]), "base64 characters, but float32"),
        "padding short": (dict(values=base64.b64encode(b"\0" * 45).decode() + "AA=="), "decodes to 46 bytes"),
        "padding inside": (dict(values="AA==" + text[4:]), "not valid base64"),
    }
    for label, (change, message) in cases.items():
        bad = tmp_path / f"bad-{label.replace(' ', '-')}.gtrace"
        bad.write_text("\n".join([*lines[:at], json.dumps({**rec, **change}), *lines[at + 1:]]) + "\n")
        with pytest.raises(TraceFormatError, match=r"tensor record '0\.weight'") as err:
            tracer.load(bad)
        assert message in str(err.value), (label, str(err.value))
        line = _one_line_error(capsys, ["diff", str(good), str(bad)])
        assert line.startswith("gradtrace diff: error: ") and message in line, (label, line)
    # a gzip file holding a valid trace with one record tampered: refused alike
    gz = tmp_path / "bad.gtrace.gz"
    tampered = [*lines[:at], json.dumps({**rec, "values": text[1:]}), *lines[at + 1:]]
    gz.write_bytes(gzip.compress(("\n".join(tampered) + "\n").encode()))
    assert "'values' holds" in _one_line_error(capsys, ["summary", str(gz)])


# ---- the headline names the changed parameters -----------------------------------------------------
def _mlp_step(perturb: list[int]) -> tracer.Trace:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    params = list(m.parameters())
    with torch.no_grad():
        for i in perturb:
            params[i].view(-1)[0] += 1e-3
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    with tracer.trace() as t:
        m(x).square().mean().backward()
        opt.step()
    return t


def test_headline_names_the_changed_parameters_first() -> None:
    base = _mlp_step([])
    r = diff(base, _mlp_step([2, 7]))
    assert r.verdict().startswith("DIVERGED — 2 parameters differ: 1.weight, 3.bias; 8 differ in all "
                                  "(value, gradient, value after the step) | forward: ")
    assert [p.name for p in r.differing_params[:2]] == ["1.weight", "3.bias"]
    assert [p["name"] for p in r.to_json()["params"][:2]] == ["1.weight", "3.bias"]
    text = _text(r)
    table = text[text.index("Parameters that differ"):]
    assert table.index("1.weight") < table.index("0.weight") and table.index("3.bias") < table.index("0.weight")
    many = diff(base, _mlp_step([0, 1, 2, 3, 4, 5, 6]))
    assert many.verdict().startswith("DIVERGED — 7 parameters differ: 0.weight, 0.bias, 1.weight, 1.bias, "
                                     "2.weight … 2 more; 8 differ in all")


# ---- two different programs ----------------------------------------------------------------------
def _chain(shared: int, other: str) -> tracer.Trace:
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    with tracer.trace() as t:
        y = x
        for _ in range(shared):
            y = y.sin()
        for _ in range(20 - shared):
            y = getattr(y, other)()
    return t


@pytest.mark.parametrize("shared, hint", [
    (0, "these traces share no calls: different models or programs? (A: 20 calls, B: 20; none align by "
        "module, op and shapes)"),
    (1, "these traces share almost no calls (1 of 20 align by module, op and shapes): different models or "
        "programs?"),
    (2, None),  # 10% aligned: two runs of one program that went different ways, listed as usual
])
def test_traces_that_share_no_calls_get_a_one_line_hint(shared: int, hint: str | None) -> None:
    r = diff(_chain(shared, "cos"), _chain(shared, "exp"))
    if hint is None:
        assert r.forward.unrelated == ""
        assert r.forward.summary().startswith(f"{20 - shared} inserted in B, {20 - shared} removed from A")
        return
    assert r.verdict() == f"DIVERGED — {hint}"
    assert r.forward.summary() == hint and r.to_json()["forward"]["unrelated"] == hint
    assert _text(r).splitlines()[0] == f"DIVERGED — {hint}"


def test_two_different_models_get_the_hint(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    cnn = SmallCNN()
    with tracer.trace() as a:
        cnn(torch.randn(2, 3, 8, 8)).sum().backward()
    model, x = hf_model("gpt2")
    with tracer.trace() as b:
        model(x, labels=x).loss.backward()
    a.save(tmp_path / "a.gtrace")
    b.save(tmp_path / "b.gtrace")
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a.gtrace"), str(tmp_path / "b.gtrace")]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("DIVERGED — these traces share no calls: different models or programs? (A: ")
    assert "inserted" not in first


@pytest.mark.browser
def test_html_page_labels_what_each_difference_is_of(kept, plain, tmp_path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        try:
            for (a, b), words, basis in (((kept[0], kept[1]), "At the origin: element-wise: max abs ", "values"),
                                         (plain, "At the origin: stats differ: max |Δ| ", "stats")):
                path = tmp_path / f"{basis}.html"
                diff_html(diff(a, b), a, b, path)
                page = browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                page.goto(path.as_uri())
                assert errors == []
                assert page.locator("#section-forward").get_by_text(words).count() == 1
                origin = page.locator("#section-forward tr.origin td")
                assert origin.nth(8).inner_text() == basis  # the "of" column
                params = page.locator("section", has_text="Parameters that differ").locator("tr").nth(1)
                assert WEIGHT in params.inner_text()  # the changed parameter first
                if basis == "stats":
                    assert "only checksums and stats are known" in page.locator("#notes").inner_text()
        finally:
            browser.close()


def test_gradtrace_run_keeps_values(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "train_tiny.py").write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for i in range(2):\n"
        "    model(torch.ones(3, 4)).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--steps", "1", "--no-progress", "--keep-values", "1.*", "--keep-values", "*@grad",
                 "-o", "kv.gtrace", "train_tiny.py"]) == 0
    t = tracer.load("kv.gtrace")
    kept = {n for n, r in t.tensors.items() if r.values is not None}
    assert {"1.weight", "1.bias", "1.weight@v1", "linear1:out", "0.weight@grad"} <= kept
    assert "0.weight" not in kept and t.header["keep_values"]["patterns"] == ["1.*", "*@grad"]
    assert main(["run", "--steps", "1", "--no-progress", "--keep-values", "params", "--keep-values-bytes", "40",
                 "-o", "p.gtrace", "train_tiny.py"]) == 0
    t = tracer.load("p.gtrace")
    # 0.weight (48 bytes) is past the cap alone; 0.bias (12) and 1.weight (24) fit; then nothing more does
    assert {n for n, r in t.tensors.items() if r.values is not None} == {"0.bias", "1.weight"}
    assert t.notes == ["values kept of 2 parameters and buffers (36 bytes of 40 bytes)",
                       "values of 6 parameters and buffers beyond the 40 bytes cap (raise keep_values_bytes); "
                       "the first: 0.weight"]
    capsys.readouterr()
    assert main(["run", "--keep-values", "params", "--keep-values", "x", "train_tiny.py"]) == 2
    assert "--keep-values params keeps every parameter" in capsys.readouterr().err


def test_fp32_against_bf16_autocast_compares_kept_values_element_wise() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    with tracer.trace(keep_values=["*"]) as a:
        ya = torch.mm(x, w)
    with tracer.trace(keep_values=["*"]) as b, torch.autocast("cpu", dtype=torch.bfloat16):
        yb = torch.mm(x, w)
    assert (ya.dtype, yb.dtype) == (torch.float32, torch.bfloat16)
    truth = (ya.double() - yb.double()).abs()
    for r in (diff(a, b, rtol=0.05), diff(a, b)):
        row = next(row for row in r.forward.rows if row.a == "mm0")
        assert row.basis == "values" and row.max_abs == truth.max().item()
        assert row.elements is not None and row.elements.differing == int((truth != 0).sum())
    assert diff(a, b, rtol=0.05).equal and not diff(a, b, rtol=1e-5).equal  # bf16 keeps ~3 digits
    exact = diff(a, b)
    assert (exact.forward.origin_a, exact.forward.reason) == ("mm0", "inputs match, outputs differ (dtype float32 vs bfloat16)")
    raw_a, raw_b = (t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in (ya, yb))
    e = element_diff(raw_a, raw_b, "float32", (8, 4), dtype_b="bfloat16")
    assert e.max_abs == truth.max().item() and e.total == 32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_values_are_the_bytes_at_record_time() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).cuda()
    x = torch.randn(8, 64, device="cuda")
    with tracer.trace(keep_values=["linear0:out*", "weight"]) as t:
        y = lin(x)
        before = y.detach().cpu().numpy().tobytes()
        y.add_(1.0)  # queued after the copy on the same stream: the kept value is the first one
        y.sum()
    assert t.tensors["linear0:out"].values == before
    assert t.tensors["weight"].values == lin.weight.detach().cpu().numpy().tobytes()
    assert t.tensors["linear0:out@v1"].values == y.detach().cpu().numpy().tobytes()
