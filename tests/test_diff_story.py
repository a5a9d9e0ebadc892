"""``gradtrace diff`` tells one story of two runs (issue 42, point 4), on traces from ``gradtrace
run`` (a small script run twice with one change) and from the API: stacks folded as ``show``
folds them, one line per parameter and the stats caveat once per table, parameters compared by
the value the step read (also a model built inside the traced step), runs that parted at an
earlier step, a random op with equal inputs, inserted and removed calls with their line, the
grammar of counts, the HTML page ("checksum only", a readable note column), phases handled
generically, and the rules that classify a row in one registry."""

from __future__ import annotations

import inspect
import io
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console

import tracer
from export.cli import main
from export.diff import DiffResult, diff, diff_html, diff_payload
from export.diff.console import record_line
from export.diff.result import Divergence, Row
from export.diff.rules import FIND_EARLIER_STEP, RANDOM_OPS, ROW_RULES, RULES, Facts, classify, random_op
from tests.fresh_stack import on_a_fresh_stack
from tests.test_dot import check_golden
from tracer.model.display import phase_key
from tracer.model.frames import folded, stack_lines

ROOT = Path(__file__).parent.parent
RNG = "random op with equal inputs: the RNG state differs"

# The program both runs execute; each pair of runs differs in one argument.
SCRIPT = '''\
import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--init-seed", type=int, default=0)
parser.add_argument("--noise-seed", type=int, default=0)
parser.add_argument("--dropout", type=float, default=0.0)
parser.add_argument("--extra", action="store_true")
parser.add_argument("--reverse-data", action="store_true")
args = parser.parse_args()
DATA = [i / 12 - 1 for i in range(24)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(6, 8), nn.Dropout(args.dropout), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if args.extra:
            h = h * 0.5
        return self.fc2(self.drop(h))


torch.manual_seed(args.init_seed)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
x = torch.tensor(DATA[::-1] if args.reverse_data else DATA).view(4, 6)
y = torch.linspace(0, 1, 8).view(4, 2)
torch.manual_seed(args.noise_seed)
for step in range(2):
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
'''
EXTRA_LINE = SCRIPT.splitlines().index("            h = h * 0.5") + 1

# GPT-2 (tiny, from a config) with clipping and AdamW: the learning-rate change of the issue.
GPT2_SCRIPT = '''\
import sys

import torch
import transformers as tf

torch.manual_seed(0)
cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
model = tf.GPT2LMHeadModel(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=float(sys.argv[1]))
x = torch.randint(0, 100, (2, 8))
for step in range(2):
    loss = model(x, labels=x).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
'''

RUNS = {  # name: (steps, arguments)
    "base0": ("0", []), "lr0": ("0", ["--lr", "0.2"]),
    "base1": ("1", []), "lr1": ("1", ["--lr", "0.2"]),
    "seed0": ("0", ["--init-seed", "1"]),
    "drop0": ("0", ["--dropout", "0.5"]), "drop0_noise": ("0", ["--dropout", "0.5", "--noise-seed", "1"]),
    "extra0": ("0", ["--extra"]),
    "reversed0": ("0", ["--reverse-data"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every trace of ``RUNS``, recorded by ``gradtrace run --steps N`` from the script."""
    where = tmp_path_factory.mktemp("runs")
    script = where / "train.py"
    script.write_text(SCRIPT)
    out = {}
    for name, (steps, argv) in RUNS.items():
        out[name] = where / f"{name}.gtrace"
        # (on a fresh stack: under pytest-xdist the worker's own frames, exec'd from strings, would
        # count as the user's; tests/fresh_stack.py)
        assert on_a_fresh_stack(main, ["run", "--steps", steps, "--no-progress", "-o", str(out[name]), str(script),
                                       *argv]) == 0
    return out


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Step 1 of the GPT-2 script at two learning rates: every parameter differs as it begins."""
    pytest.importorskip("transformers")
    where = tmp_path_factory.mktemp("gpt2")
    (where / "gpt2_train.py").write_text(GPT2_SCRIPT)
    paths = (where / "a.gtrace", where / "b.gtrace")
    for path, lr in zip(paths, ("1e-3", "2e-3")):  # the real command line, as a user runs it
        proc = subprocess.run([sys.executable, "-m", "tracer", "run", "--steps", "1", "--no-progress", "-o", path.name,
                               "gpt2_train.py", lr], cwd=where, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    return paths


def _text(result: DiffResult) -> str:
    buf = io.StringIO()
    result.render(Console(file=buf, width=120, color_system=None, highlight=False, markup=False, emoji=False,
                          soft_wrap=False))
    return buf.getvalue()


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    main(["diff", *argv])
    return capsys.readouterr().out


# ---- API runs ---------------------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self, dropout: float = 0.0, extra: bool = False) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(6, 8), nn.Dropout(dropout), nn.Linear(8, 2)
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.extra:
            h = h * 0.5
        return self.fc2(self.drop(h))


API_EXTRA_LINE = Net.forward.__code__.co_firstlineno + inspect.getsource(Net.forward).splitlines().index(
    "            h = h * 0.5")
X, Y = torch.linspace(-1, 1, 24).view(4, 6), torch.linspace(0, 1, 8).view(4, 2)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    ((model(X) - Y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def api_run(*, lr: float = 0.1, init_seed: int = 0, traced_step: int = 0, build_inside: bool = False,
            dropout: float = 0.0, noise_seed: int = 0, extra: bool = False) -> tracer.Trace:
    """The script's training loop through ``tracer.trace``: step ``traced_step`` traced, with the
    model built inside the block when ``build_inside`` (as ``gradtrace run --steps 0`` does)."""
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(init_seed)
        model = Net(dropout, extra)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        torch.manual_seed(noise_seed)
        return model, opt

    if build_inside:
        with tracer.trace() as t:
            model, opt = build()
            _step(model, opt)
        return t
    model, opt = build()
    for _ in range(traced_step):
        _step(model, opt)
    with tracer.trace() as t:
        _step(model, opt)
    return t


# ---- parameters by the value the step read ----------------------------------------------------------------
STEP0_LR = ("DIVERGED — optimizer: first at SGD0 (torch.optim.sgd.SGD.step in <root>, optimizer): inputs match, "
            "arguments differ ('lr=0.1' vs 'lr=0.2'), outputs differ | "
            "backward: equal (12 aligned) | 4 parameters differ (value after the step)")


def _check_step0_lr(r: DiffResult) -> None:
    assert [p.name for p in r.params] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for p in r.params:  # the value the step read (made by its init calls), its gradient: equal; the update not
        assert p.made_in_step and p.read == p.name
        assert (p.value.status, p.grad and p.grad.status, p.updated and p.updated.status) == ("equal", "equal", "differ")
    assert not r.parted_earlier


def test_steps_0_compares_parameters_by_the_value_the_step_read(runs: dict[str, Path], capsys: Any) -> None:
    r = diff(runs["base0"], runs["lr0"])
    _check_step0_lr(r)
    assert r.verdict() == STEP0_LR
    capsys.readouterr()
    assert main(["diff", str(runs["base0"]), str(runs["lr0"]), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["params_compared"] == 4 and [p["read"] for p in data["params"]] == [p.name for p in r.params]
    # the API: the model built inside the traced block
    api = diff(api_run(build_inside=True), api_run(build_inside=True, lr=0.2))
    _check_step0_lr(api)
    assert api.verdict() == STEP0_LR.replace("12 aligned", f"{api.backward.compared} aligned")


# ---- runs that parted at an earlier step ----------------------------------------------------------------
def test_parameters_that_differed_as_the_step_began_point_to_an_earlier_step(runs: dict[str, Path]) -> None:
    earlier = ("DIVERGED — all 4 parameters differed as the step began: the runs parted at an earlier step; to find "
               "it, run both with `gradtrace run --log a.gtsteps …` and `gradtrace bisect a.gtsteps b.gtsteps` | "
               "forward: first at linear0 ")
    for r in (diff(runs["base1"], runs["lr1"]), diff(api_run(traced_step=1), api_run(traced_step=1, lr=0.2))):
        assert r.parted_earlier
        assert r.verdict().startswith(earlier), r.verdict()
        assert FIND_EARLIER_STEP in r.verdict()
    # Not for parameters the step itself made (another init seed: the origin is in the step) ...
    seeded = diff(runs["base0"], runs["seed0"])
    assert not seeded.parted_earlier and seeded.verdict().startswith(
        "DIVERGED — 4 parameters differ: fc1.weight, fc1.bias, fc2.weight, fc2.bias | forward: first at "
        "kaiming_uniform_0 ")
    # ... nor for one changed weight among several
    base = api_run()
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc2.bias[0] += 0.5
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace() as t:
        _step(model, opt)
    one = diff(base, t)
    assert not one.parted_earlier and one.verdict().startswith("DIVERGED — 1 parameter differs: fc2.bias (")


# ---- random ops ---------------------------------------------------------------------------------------------
def test_a_model_built_with_another_seed_differs_at_its_first_init(runs: dict[str, Path]) -> None:
    for r in (diff(runs["base0"], runs["seed0"]), diff(api_run(build_inside=True),
                                                       api_run(build_inside=True, init_seed=1))):
        o = r.forward.origin
        assert o is not None and (o.a, o.what, o.rule) == ("kaiming_uniform_0", "torch.nn.init.kaiming_uniform_",
                                                           "random-op")
        assert r.forward.reason == RNG
        assert all(p.value.status == "differ" and p.made_in_step for p in r.params)


RANDOM_CALLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "dropout": lambda x: F.dropout(x, 0.5),
    "randn": lambda x: x + torch.randn(4, 6),
    "rand": lambda x: x * torch.rand(4, 6),
    "randint": lambda x: x + torch.randint(0, 3, (4, 6)),
    "multinomial": lambda x: x[torch.multinomial(x.softmax(0)[:, 0], 2)],
    "bernoulli": lambda x: x * torch.bernoulli(x.sigmoid()),
    "randperm": lambda x: x[torch.randperm(4)],
    "normal_": lambda x: x + torch.empty(4, 6).normal_(),
    "uniform_": lambda x: x + torch.empty(4, 6).uniform_(),
}


def _random_trace(op: str, seed: int, shift: float = 0.0) -> tracer.Trace:
    x = X + shift
    torch.manual_seed(seed)
    with tracer.trace() as t:
        RANDOM_CALLS[op](x).sum()
    return t


@pytest.mark.parametrize("op", list(RANDOM_CALLS))
def test_a_random_op_with_equal_inputs_says_the_rng_state_differs(op: str) -> None:
    r = diff(_random_trace(op, 0), _random_trace(op, 1))
    o = r.forward.origin
    assert o is not None and o.rule == "random-op" and random_op(o.what) is not None
    assert o.what.rpartition(".")[2] == op and r.forward.reason == RNG
    assert f"{o.a} ({o.what} in <root>): {RNG}" in r.verdict()
    # the same op with a changed input: the input is the story, not the RNG
    changed = diff(_random_trace(op, 0), _random_trace(op, 0, shift=1.0))
    assert changed.forward.origin is not None and changed.forward.origin.rule != "random-op"


def test_a_random_op_whose_arguments_differ_names_the_arguments_not_the_rng() -> None:
    """Dropout with another ``p`` under the same seed: the RNG state is the same in both runs; the
    arguments are the difference the trace knows."""
    def run(p: float) -> tracer.Trace:
        torch.manual_seed(0)
        with tracer.trace() as t:
            F.dropout(X, p).sum()
        return t

    r = diff(run(0.1), run(0.3))
    o = r.forward.origin
    assert o is not None and (o.a, o.rule) == ("dropout0", "arguments-differ")
    assert "inputs match, arguments differ ('p=0.1' vs 'p=0.3'), outputs differ" in r.verdict()
    assert RNG not in r.verdict()


def test_dropout_with_another_seed_in_a_gradtrace_run(runs: dict[str, Path], capsys: Any) -> None:
    r = diff(runs["drop0"], runs["drop0_noise"])
    o = r.forward.origin
    assert o is not None and (o.a, o.what, o.rule) == ("dropout0", "torch.nn.functional.dropout", "random-op")
    assert r.verdict().startswith(f"DIVERGED — forward: first at dropout0 (torch.nn.functional.dropout in drop): {RNG}")
    assert f"First forward divergence: {RNG}" in _cli(capsys, str(runs["drop0"]), str(runs["drop0_noise"]))


class Scale(torch.autograd.Function):
    """Identity forward; a backward that scales by a factor the test picks (and forward never sees)."""

    k = 1.0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * Scale.k


def test_a_backward_that_computes_otherwise_is_backward_only() -> None:
    traces = []
    for k in (1.0, 2.0):
        Scale.k = k
        x = X.clone().requires_grad_()
        with tracer.trace() as t:
            Scale.apply(x).pow(2).sum().backward()
        traces.append(t)
    r = diff(*traces)
    o = r.backward.origin
    assert r.forward.equal and o is not None and (o.a, o.rule) == ("mul0", "backward-only")
    # The factor is the call's argument: a known difference, named (not a guess at nondeterminism).
    assert r.backward.reason == ("backward-only: mul0 in the backward of Scale0/ScaleBackward: inputs match, "
                                 "arguments differ ('1.0' vs '2.0'), outputs differ while Scale0 matched in forward")


# ---- inserted and removed calls --------------------------------------------------------------------------
def test_inserted_and_removed_calls_show_their_line(runs: dict[str, Path], capsys: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(runs["base0"].parent)
    for a, b, status in (("base0", "extra0", "inserted"), ("extra0", "base0", "removed")):
        r = diff(runs[a], runs[b])
        row = next(row for row in r.forward.rows if row.status == status)
        assert (row.a or row.b, row.rule, row.phase) == ("mul0", status, "forward")
        where = f"train.py:{EXTRA_LINE}  h = h * 0.5"
        side = r.trace_b if status == "inserted" else r.trace_a
        assert record_line(side, "mul0") == where
        out = _cli(capsys, f"{a}.gtrace", f"{b}.gtrace")
        table = out[out.index("forward: inserted in B / removed from A"):]
        assert re.search(rf"│ {'—' if status == 'inserted' else 'mul0'} +│ {'mul0' if status == 'inserted' else '—'} +"
                         rf"│ forward +│ <root> +│ Tensor\.mul +│ {re.escape(where)} +│", table), table
        assert re.search(rf"mul0/MulBackward0 +│ (— +│ )?backward +│ <root> +│ MulBackward0 +│ {re.escape(where)} +│", out)
        page = diff_payload(r, r.trace_a, r.trace_b)  # type: ignore[arg-type]
        assert [row[11] for row in page["sections"][0]["rows"] if row[4] == status] == [where]
    api = diff(api_run(), api_run(extra=True))
    assert api.forward.inserted == ["mul0"]
    assert record_line(api.trace_b, "mul0").endswith(f"test_diff_story.py:{API_EXTRA_LINE}  h = h * 0.5")


# ---- stacks folded like show; one line per parameter; the caveat once per table ---------------------------
def test_gpt2_lr_change_reads_in_a_screen_with_folded_stacks(gpt2_runs: tuple[Path, Path], capsys: Any) -> None:
    a, b = gpt2_runs
    r = diff(a, b)
    out = _cli(capsys, str(a), str(b))
    lines = out.splitlines()
    # The issue measured 242 lines and the caveat 87-93 times; four lines per parameter.
    assert len(lines) <= 125, len(lines)
    assert out.count("min/max/mean/absmax") == 4  # the note, each section's origin, the parameters' table
    params = [p.name for p in r.params]
    assert len(params) == 28 and r.parted_earlier
    for name in params:  # one line each, and its three comparisons on it
        rows = [line for line in lines if re.match(rf"│ {re.escape(name)} +│", line)]
        assert len(rows) == 1 and rows[0].count("(rel ") == 3, rows
    # The stacks as `gradtrace show` prints them: the user's line, library frames folded, the
    # innermost frame. With transformers 5.25 the user's line is more than six frames out (the
    # old stack[-6:] cut it off); older releases nest fewer frames (5.17: six), so the depth is
    # not asserted: the user's line must be printed whatever the depth.
    stack = r.forward.stack_a
    user = max(i for i, f in enumerate(stack) if f.code == "loss = model(x, labels=x).loss")
    assert stack[user].file.endswith("gpt2_train.py")
    shown = stack_lines(stack)
    assert "".join(f"{line}\n" for line in shown) in out
    assert "loss = model(x, labels=x).loss" in "".join(shown)
    if any(folded(stack)):
        assert any(re.fullmatch(r"  \.\.\. \d+ frames folded \(\d+ library\)", line) for line in shown)
    assert stack[-1].code in out and f"B: {r.forward.origin_b}, the same stack" in out
    assert f"({sum(folded(stack))} frames folded: --all-frames shows every frame)" in out
    every = _cli(capsys, str(a), str(b), "--all-frames")
    assert "".join(f"{line}\n" for line in stack_lines(stack, all_frames=True)) in every


def test_api_stacks_are_folded_like_show() -> None:
    pytest.importorskip("transformers")
    from tests.models import hf_model

    traces = []
    for lr in (1e-3, 2e-3):
        torch.manual_seed(0)
        model, ids = hf_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        with tracer.trace() as t:
            model(ids, labels=ids).loss.backward()
        traces.append(t)
    r = diff(*traces)
    text = _text(r)
    stack = r.forward.stack_a
    assert stack[-1].code == "inputs_embeds = self.wte(input_ids)"
    assert any(f.code == "model(ids, labels=ids).loss.backward()" for f in stack)
    assert "".join(f"{line}\n" for line in stack_lines(stack)) in text
    assert "modeling_gpt2.py" in text and "torch/nn/modules/module.py" not in text
    # one line per parameter, the caveat once per table, here too
    assert r.parted_earlier and text.count("min/max/mean/absmax") == 4
    lines = text.splitlines()
    for p in r.params:
        assert sum(1 for line in lines if re.match(rf"│ {re.escape(p.name)} +│", line)) == 1


def test_lr_change_golden(tmp_path: Path, update_golden: bool, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """The whole output for a learning-rate change, traced by the real command line at step 1."""
    (tmp_path / "train.py").write_text(SCRIPT)
    for name, lr in (("a", "0.1"), ("b", "0.2")):
        proc = subprocess.run([sys.executable, "-m", "tracer", "run", "--steps", "1", "--no-progress", "-o",
                               f"{name}.gtrace", "train.py", "--lr", lr], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
    monkeypatch.chdir(tmp_path)
    out = _cli(capsys, "a.gtrace", "b.gtrace")
    check_golden("diff_lr_change.txt", out.replace(str(tmp_path), "<tmp>"), update_golden)


# ---- grammar --------------------------------------------------------------------------------------------
def test_counts_of_one_read_in_the_singular(runs: dict[str, Path]) -> None:
    def one_weight(lr: float) -> tracer.Trace:
        torch.manual_seed(0)
        lin, x = nn.Linear(4, 2, bias=False), X[:, :4]
        opt = torch.optim.SGD(lin.parameters(), lr=lr)
        with tracer.trace() as t:
            lin(x).sum().backward()
            opt.step()
        return t

    r = diff(one_weight(0.1), one_weight(0.2))
    assert r.verdict().endswith("| 1 parameter differs (value after the step)")  # (its gradient is equal)
    assert re.search(r"│ parameters +│ +1 │ +1 │ +│ +│ 1 parameter differs \(value after the step\)", _text(r))
    same = diff(one_weight(0.1), one_weight(0.1))
    assert same.verdict().startswith("EQUAL: 3 calls, ") and same.verdict().endswith(" and 1 parameter bit-identical")
    drop = diff(runs["drop0"], runs["drop0_noise"])
    assert "; 1 call after backward differs via gradients |" in drop.verdict()
    for text in (r.verdict(), _text(r), drop.verdict(), _text(drop)):
        assert not re.search(r"\b1 (parameter|call|record|aligned record)s?( after \w+)? differ\b", text)
        assert not re.search(r"\b1 (calls|parameters|records)\b", text)


# ---- the HTML page ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        yield browser
        browser.close()


def _page(browser: Any, path: Path, width: int = 1000) -> Any:
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    assert errors == []
    return page


def _reversed_data() -> tuple[tracer.Trace, tracer.Trace]:
    traces = []
    for values in (X.flatten().tolist(), X.flatten().tolist()[::-1]):
        with tracer.trace() as t:
            torch.tensor(values).view(4, 6).sum(1)
        traces.append(t)
    return traces[0], traces[1]


@pytest.mark.browser
def test_html_says_checksum_only_and_keeps_the_note_readable(runs: dict[str, Path], chromium: Any,
                                                              tmp_path: Path) -> None:
    for name, (a, b) in (("run", (tracer.load(runs["base0"]), tracer.load(runs["reversed0"]))),
                         ("api", _reversed_data())):
        r = diff(a, b)
        origin = r.forward.origin
        # the same values in another order: every stat equal, the checksums differ
        assert origin is not None and origin.a == "tensor0" and origin.checksum_only and origin.max_abs == 0
        path = tmp_path / f"{name}.html"
        diff_html(r, a, b, path)
        page = _page(chromium, path)
        cells = page.locator("#section-forward tr.origin td")
        assert [cells.nth(k).inner_text() for k in (6, 7, 8)] == ["checksum only", "", "stats"]
        rows = page.locator("#section-forward tbody tr")
        shown = [rows.nth(k).locator("td").nth(6).inner_text() for k in range(rows.count())]
        assert shown.count("checksum only") == sum(1 for row in r.forward.rows if row.checksum_only)
        note = cells.nth(9)
        assert note.inner_text() == origin.note
        box = note.bounding_box()
        assert box["width"] >= 300 and box["height"] <= 150, box  # a column, not a ribbon of letters


@pytest.mark.browser
def test_html_folds_the_stacks_and_shows_inserted_lines(runs: dict[str, Path], chromium: Any,
                                                        tmp_path: Path) -> None:
    r = diff(runs["base0"], runs["extra0"])
    path = tmp_path / "extra.html"
    assert r.trace_a is not None and r.trace_b is not None
    diff_html(r, r.trace_a, r.trace_b, path)
    page = _page(chromium, path)
    inserted = page.locator("#section-forward tr.inserted td")
    assert inserted.nth(9).inner_text() == " ".join(f"at {record_line(r.trace_b, 'mul0')}".split())
    stack = page.locator("#section-backward .stacks .stack").first
    folds = stack.locator("details.fold")
    frames = r.backward.stack_a
    hidden = sum(1 for line in stack_lines(frames) if line.startswith("  ... "))
    assert folds.count() == hidden >= 1  # gradtrace run's own frames, above the script's
    outermost = f"{frames[0].file}:{frames[0].line} in {frames[0].function}"  # a folded frame
    text = stack.inner_text()
    assert "loss = ((model(x) - y) ** 2).mean()" in text and outermost not in text
    folds.first.locator("summary").click()
    assert outermost in stack.inner_text()


# ---- phases ------------------------------------------------------------------------------------------------
def _with_phases(t: tracer.Trace, later: dict[str, str]) -> tracer.Trace:
    """``t`` with the calls from its optimizer step on (those after the backward) given the phase
    a newer recorder writes (``optimizer``), or the one ``later`` names (a phase this reader does
    not know)."""
    first = next(i for i, c in enumerate(t.calls) if c.kind == "optimizer")
    for c in t.calls[first:]:
        c.phase = later.get(c.name, "optimizer")  # type: ignore[assignment]
    return t


def _phased(lr: float, shift: float) -> tracer.Trace:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with tracer.trace() as t:
        loss = ((model(X + shift) - Y) ** 2).mean()
        loss.backward()
        opt.step()
        loss.detach() * 2   # after backward: the optimizer phase (a logged statistic)
        loss.detach() + 1   # a phase this reader does not know
    add = next(c.name for c in reversed(t.calls) if c.api == "Tensor.add")
    return _with_phases(t, {add: "ema"})


def test_phases_beyond_forward_and_backward_are_compared_and_shown(tmp_path: Path) -> None:
    assert sorted(["ema", "optimizer", "backward", "forward"], key=phase_key) == \
        ["forward", "backward", "optimizer", "ema"]
    r = diff(_phased(0.1, 0.0), _phased(0.2, 0.0))
    o = r.forward.origin
    assert o is not None and (o.a, o.phase) == ("SGD0", "optimizer")
    assert r.forward.summary() == ("first at SGD0 (torch.optim.sgd.SGD.step in <root>, optimizer): inputs match, "
                                   "arguments differ ('lr=0.1' vs 'lr=0.2'), outputs differ")
    assert r.verdict().startswith("DIVERGED — optimizer: first at SGD0 ")
    assert r.forward.compared == sum(1 for c in r.trace_a.calls if c.phase != "backward")  # type: ignore[union-attr]
    assert "│ phase      │ optimizer" in _text(r)
    assert r.to_json()["forward"]["origin"]["phase"] == "optimizer"
    # contaminated records grouped by phase, in the order a step runs them, the unknown one last
    shifted = diff(_phased(0.1, 0.0), _phased(0.1, 0.5))
    assert re.search(r"; \d+ later records contaminated \(\d+ forward, \d+ optimizer, 1 ema\)", shifted.forward.summary())
    page = diff_payload(r, r.trace_a, r.trace_b)  # type: ignore[arg-type]
    assert page["sections"][0]["origin_phase"] == "optimizer"
    assert {row[9] for row in page["sections"][0]["rows"]} == {"forward", "optimizer", "ema"}


# ---- the rules ------------------------------------------------------------------------------------------------
def test_every_rule_names_its_case_and_a_test_that_exists() -> None:
    assert len(RULES) == len(ROW_RULES)
    for rule in ROW_RULES:
        assert rule.name and rule.matches and rule.admitted_by, rule
        _assert_test_exists(rule.test)
    seen: set[str] = set()
    for group in RANDOM_OPS:
        assert group.apis and not group.apis & seen, group.name  # each API in one group
        seen |= group.apis
        _assert_test_exists(group.test)
    assert random_op("torch.nn.functional.dropout") == "dropout" and random_op("Tensor.normal_") == "sampling"
    assert random_op("mymodel.dropout") is None and random_op("torch.nn.functional.linear") is None
    # the first match wins: a random op with equal inputs is one before it is "outputs differ"
    assert classify(Facts("call", "randn0", "torch.randn")).name == "random-op"
    assert classify(Facts("call", "add0", "Tensor.add")).name == "outputs-differ"
    assert classify(Facts("call", "add0", "Tensor.add", frozenset({"forward", "source"}))).name == "contaminated"


def _assert_test_exists(ref: str) -> None:
    path, _, name = ref.partition("::")
    assert (ROOT / path).is_file(), ref
    assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), ref


def test_the_json_names_each_records_rule(runs: dict[str, Path]) -> None:
    data = diff(runs["drop0"], runs["drop0_noise"]).to_json()
    assert data["forward"]["origin"]["rule"] == "random-op" and data["forward"]["origin"]["phase"] == "forward"
    assert {r["rule"] for r in data["forward"]["records"]} >= {"random-op", "contaminated", "gradient"}


def _sparse_embedding_trace(label: int) -> tracer.Trace:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    ids, target = torch.tensor([1, 2, 3]), torch.tensor([0, 1, label])
    with tracer.trace() as t:
        F.cross_entropy(emb(ids), target).backward()
        opt.step()
    return t


def test_a_call_reading_an_unhashed_value_is_not_called_an_origin() -> None:
    """``Embedding(sparse=True)``'s gradient is sparse, which is not hashed: the SparseAdam step
    that reads it differs while every input it could compare matches. It is not another place
    where a difference enters ('inputs match, outputs differ'): the sparse gradient may differ."""
    r = diff(_sparse_embedding_trace(2), _sparse_embedding_trace(3))
    assert r.forward.origin is not None and r.forward.origin.a == "cross_entropy0"
    assert r.forward.independent == []
    step = next(row for row in r.forward.rows if row.a == "SparseAdam0")
    assert (step.status, step.rule) == ("unknown", "unknown-input")
    assert step.note == ("outputs differ; no compared input differs, but weight@grad (not hashed: sparse_coo layout) "
                         "could not be compared: the difference may come from there")
    assert r.forward.unknown == 1


def test_the_later_records_of_a_verdict_add_up_over_their_phases() -> None:
    """The count of later differing records (carried on, or a difference of their own) and its
    split by phase count the same rows."""
    d = Divergence("forward")
    d.rows = [Row("mul0", "mul0", "m", "torch.mul", status="origin", phase="forward"),
              Row("add0", "add0", "m", "torch.add", status="contaminated", phase="forward"),
              Row("randn0", "randn0", "", "torch.randn", status="new", phase="optimizer"),
              Row("sub0", "sub0", "", "torch.sub", status="contaminated", phase="optimizer")]
    d.origin, d.reason = d.rows[0], "inputs match, outputs differ"
    d.contaminated = {"m": 1, "": 2}
    assert d.summary().endswith("; 3 later records contaminated (1 forward, 2 optimizer)")


def _bn_trace(shift: float) -> tracer.Trace:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(4, 4)
    x[0, 0] += shift
    with tracer.trace() as t:
        m(x).sum().backward()
        m[1].running_mean.clone()  # read after the forward changed it (an EMA or SWA copy of buffers)
    return t


def test_a_buffer_batch_norm_updates_is_compared_as_it_was_before_the_step() -> None:
    """Batch norm changes its running stats in its forward; a later read (an EMA copy) reads the
    new value, which the step made from its input. The value before the step is the buffer as
    it came in: equal here, where only the input changed, so the verdict leads with the forward
    origin, not with 'parameters differ'."""
    r = diff(_bn_trace(0.0), _bn_trace(1.0))
    stat = next(p for p in r.params if p.name == "1.running_mean")
    assert (stat.read, stat.made_in_step, stat.buffer, stat.value.status) == ("1.running_mean", False, True, "equal")
    assert r.verdict().startswith("DIVERGED — forward: first at linear0 (torch.nn.functional.linear in 0): "
                                  "first call to read the changed input input0")


def test_the_first_reader_of_a_changed_parameter_is_said_to_match_only_when_it_did() -> None:
    """A builds its Linear inside the block (``gradtrace run``'s step 0), B outside with another
    seed: forward finds no origin (A's init calls have no counterpart), and linear0, the first
    reader of the changed weight, differs: the verdict names it without 'whose outputs matched'."""
    x = torch.randn(4, 8)
    with tracer.trace() as a:
        torch.manual_seed(0)
        nn.Linear(8, 4)(x).sum().backward()
    torch.manual_seed(1)
    m = nn.Linear(8, 4)
    with tracer.trace() as b:
        m(x).sum().backward()
    r = diff(a, b)
    assert r.forward.origin is None
    assert r.verdict().startswith("DIVERGED — 2 parameters differ: weight, bias; first read by linear0 | forward:")


def test_an_optimizer_step_records_its_settings_and_a_diff_names_the_one_that_differs() -> None:
    def step(head_lr: float) -> tracer.Trace:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        opt = torch.optim.AdamW([{"params": model[0].parameters()},
                                 {"params": model[1].parameters(), "lr": head_lr, "weight_decay": 0.0}], lr=1e-3)
        with tracer.trace() as t:
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        return t

    a, b = step(1e-4), step(1e-3)
    # Group 0's settings by name, group 1's as g1.<name>, the learning rates first.
    assert a["AdamW0"].args == ("lr=0.001, g1.lr=0.0001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01, "
                                "decoupled_weight_decay=True, g1.weight_decay=0.0, g1.betas=(0.9, 0.999), "
                                "g1.eps=1e-08, g1.decoupled_weight_decay=True")
    r = diff(a, b)
    assert r.forward.origin is not None and r.forward.origin.a == "AdamW0"
    assert r.forward.reason == "inputs match, arguments differ ('g1.lr=0.0001' vs 'g1.lr=0.001'), outputs differ"
    assert r.verdict().startswith("DIVERGED — optimizer: first at AdamW0 (torch.optim.adamw.AdamW.step in <root>, "
                                  "optimizer): inputs match, arguments differ ('g1.lr=0.0001' vs 'g1.lr=0.001')")


def test_a_diff_counts_parameters_and_buffers_apart() -> None:
    def step(lr: float, seed: int = 1) -> tracer.Trace:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
        with tracer.trace() as t:
            model(x).sum().backward()
            opt.step()
        return t

    equal = diff(step(0.1), step(0.1))
    # 6 parameters; BatchNorm's running_mean, running_var and num_batches_tracked are buffers.
    assert equal.verdict().endswith("and 6 parameters and 3 buffers bit-identical")
    changed = diff(step(0.1), step(0.2))
    differing = changed.differing_params
    assert differing and not any(p.buffer for p in differing)  # (the lr moves no buffer)
    assert changed.verdict().endswith(f"| {len(differing)} parameters differ (value after the step)")
    other_data = diff(step(0.1), step(0.1, seed=2))  # BatchNorm's running statistics move too
    assert [p.name for p in other_data.differing_params if p.buffer] == ["1.running_mean", "1.running_var"]
    assert other_data.verdict().endswith("| 4 parameters and 2 buffers differ (gradient, value after the step)")
