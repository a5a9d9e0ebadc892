"""Graphviz export: golden DOT files, structure checked against the trace, folding, rendering,
the ``gradtrace dot`` command, and ``backward_graph`` on a Hugging Face model output.

Golden files live in tests/golden and are rewritten only with ``pytest --update-golden``. They are
made with ``checksums=False``: float results may differ in the last bit between CPUs, names and
structure may not.
"""

from __future__ import annotations

import difflib
import gc
import os
import re
import shutil
import weakref
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer
from export.cli import main
from export.dot import RenderError, dot
from export.dot.backward_graph import backward_graph
from export.errors import UserError

GOLDEN = Path(__file__).parent / "golden"
SVG_TEXT = "{http://www.w3.org/2000/svg}text"
MISSING_DOT = ("rendering .svg needs Graphviz's `dot` program: apt-get install graphviz "
               "(or brew install graphviz); writing .dot works without it")
# Rendering needs Graphviz's program (CI installs it, and .ci/run fails without it).
needs_dot_program = pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot program")


# ---- small models ------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden)
        self.proj = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.relu(self.fc(x)))


class TwoBlockMLP(nn.Module):
    def __init__(self, hidden: tuple[int, int] = (8, 8)) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(4, hidden[0]), Block(4, hidden[1]))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class Double(torch.autograd.Function):
    __module__ = "models"  # the API name is module-qualified; keep it independent of how pytest imports us

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class ScaledMatmul(torch.autograd.Function):
    """A custom Function whose forward applies another one (nesting)."""

    __module__ = "models"

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return Double.apply(x) @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return 2 * (g @ w.t()), 2 * (x.t() @ g)


class WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaledMatmul.apply(self.lin(x), self.w).sum()


def mlp_trace(hidden: tuple[int, int] = (8, 8)) -> tracer.Trace:
    torch.manual_seed(0)
    model = TwoBlockMLP(hidden)
    x = torch.randn(3, 4)
    with tracer.trace() as t:
        model(x).pow(2).mean().backward()
    return t


def function_trace() -> tracer.Trace:
    torch.manual_seed(0)
    model = WithFunction()
    x = torch.randn(2, 4)
    with tracer.trace() as t:
        model(x).backward()
    return t


@pytest.fixture(scope="module")
def mlp() -> tracer.Trace:
    return mlp_trace()


# ---- reading DOT back --------------------------------------------------------------------------
_ATTR = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_NODE = re.compile(r"^\s*(\w+) \[(.*)\];$")
_EDGE = re.compile(r"^\s*(\w+) -> (\w+) \[(.*)\];$")


def _unescape(value: str) -> list[str]:
    lines = re.split(r"(?<!\\)\\n", value)  # a \n not preceded by an escaping backslash
    return [re.sub(r"\\(.)", r"\1", line) for line in lines]


def parse(text: str) -> tuple[dict[str, dict[str, list[str]]], list[tuple[str, str, dict[str, list[str]]]]]:
    nodes: dict[str, dict[str, list[str]]] = {}
    edges: list[tuple[str, str, dict[str, list[str]]]] = []
    for line in text.splitlines():
        if m := _EDGE.match(line):
            edges.append((m[1], m[2], {k: _unescape(v) for k, v in _ATTR.findall(m[3])}))
        elif (m := _NODE.match(line)) and m[1] not in ("graph", "node", "edge"):
            assert m[1] not in nodes, f"node {m[1]} defined twice"
            nodes[m[1]] = {k: _unescape(v) for k, v in _ATTR.findall(m[2])}
    return nodes, edges


def check_golden(name: str, text: str, update: bool) -> None:
    path = GOLDEN / name
    if update:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"{path} is missing: run pytest --update-golden and review the new file"
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            f"golden/{name}", "now", n=1))
        pytest.fail(f"DOT text differs from golden/{name} (pytest --update-golden if intended):\n{diff}")


def svg_texts(path: Path) -> list[str]:
    return [e.text or "" for e in ET.parse(path).getroot().iter(SVG_TEXT)]


# ---- golden files ------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "options"), [
    ("mlp.dot", {}),
    ("mlp_depth1.dot", {"depth": 1}),
    ("mlp_fold_repeats.dot", {"fold_repeats": True}),
    ("mlp_forward_only.dot", {"backward": False}),
])
def test_mlp_golden(mlp, update_golden, name, options):
    check_golden(name, dot(mlp, checksums=False, **options), update_golden)


def test_custom_function_golden(update_golden):
    check_golden("custom_function.dot", dot(function_trace(), checksums=False), update_golden)


def test_backward_graph_golden(update_golden):
    torch.manual_seed(0)
    model = TwoBlockMLP()
    out = model(torch.randn(3, 4))
    check_golden("mlp_backward_graph.dot", backward_graph({"out": out, "loss": out.pow(2).mean()},
                                                          params=model), update_golden)


# ---- structure against the trace ---------------------------------------------------------------
def test_every_call_and_grad_node_appears_once_and_linked(mlp):
    nodes, edges = parse(dot(mlp))
    for i, c in enumerate(mlp.calls):
        assert nodes[f"c{i}"]["label"][0] == c.name
        assert [n for n, a in nodes.items() if a["label"][0] == c.name] == [f"c{i}"]
    gid = {n.name: f"g{i}" for i, n in enumerate(mlp.grad_nodes)}
    for n in mlp.grad_nodes:
        label = nodes[gid[n.name]]["label"]
        if n.param is not None:  # leaves are named by parameter
            assert label[:2] == [n.param, "AccumulateGrad"]
        else:
            assert label == [n.name]
    links = {(s, d) for s, d, a in edges if a.get("style") == ["dashed"]}
    for i, c in enumerate(mlp.calls):
        for g in c.grad_nodes:
            assert (f"c{i}", gid[g]) in links, f"no dashed link {c.name} -- {g}"
    # Gradient edges: written against the flow (dir=back) and labelled with the gradient's name.
    grads = {(d, s): a for s, d, a in edges if a.get("dir") == ["back"]}
    for n in mlp.grad_nodes:
        for i, dest in enumerate(n.next):
            if dest is not None:
                assert grads[(gid[n.name], gid[dest])]["label"][0] == n.grads_out[i]
    assert len(grads) == sum(d is not None for n in mlp.grad_nodes for d in n.next) + 1  # + run -> root


def test_tensor_edges_carry_name_shape_dtype_and_checksum(mlp):
    _, edges = parse(dot(mlp))
    labels = {a["label"][0]: a["label"] for s, d, a in edges if "label" in a and s.startswith(("c", "s"))}
    for c in mlp.calls:
        for name in c.inputs:
            rec = mlp.tensors[name]
            assert labels[name] == [name, f"[{', '.join(map(str, rec.shape))}] {rec.dtype}", "#" + rec.md5[:8]]
    assert labels["linear0:out"][1] == "[3, 8] float32"
    no_sums = parse(dot(mlp, checksums=False))[1]
    assert not any(line.startswith("#") for *_, a in no_sums for line in a.get("label", []))


def test_outside_tensors_are_marked_source_nodes(mlp):
    nodes, _ = parse(dot(mlp))
    sources = {a["label"][0]: a for n, a in nodes.items() if n.startswith("s")}
    params = [name for name, rec in mlp.tensors.items() if rec.role == "param"]
    assert sorted(sources) == sorted(["input0", *params])
    assert sources["input0"]["label"][-1] == "source: input"
    assert sources["blocks.0.fc.weight"]["label"][-1] == "source: param"
    assert {a["shape"][0] for a in sources.values()} == {"invhouse"}


def test_legend_and_backward_run(mlp):
    text = dot(mlp)
    nodes, edges = parse(text)
    assert "subgraph cluster_legend {" in text
    legend = [a["label"][0] for n, a in nodes.items() if n.startswith("legend") and a.get("label") != [""]]
    assert legend[:3] == ["forward API call: name, API, args", "source tensor from outside the block:",
                          "backward run"]
    assert "AccumulateGrad leaf, named by parameter" in legend
    assert nodes["b0"]["label"] == ["backward0", "Tensor.backward"]
    loss_call = f"c{[c.name for c in mlp.calls].index('mean0')}"
    assert any(s == loss_call and d == "b0" and a["label"][0] == "mean0:out" for s, d, a in edges)


def test_depth_folding(mlp):
    full, _ = parse(dot(mlp))
    nodes, edges = parse(dot(mlp, depth=1))
    assert len(nodes) < len(full)
    blocks_calls = [c for c in mlp.calls if c.module.startswith("blocks")]
    fold = nodes["m0"]["label"]
    assert fold[:2] == ["blocks (Sequential)", f"×{len(blocks_calls)} calls"]
    assert nodes["m1"]["label"][:2] == ["head (Linear)", "×1 call"]
    assert fold[2:] == ["in: [3, 4] float32", "out: [3, 4] float32", "8 params"]
    assert nodes["mb0"]["label"][0] == "blocks (Sequential)"
    for i, c in enumerate(mlp.calls):  # folded calls have no node of their own
        assert (f"c{i}" in nodes) == (c.module == "")
    assert ("m0", "mb0") in {(s, d) for s, d, a in edges if a.get("style") == ["dashed"]}
    assert not any(s == d for s, d, _ in edges)
    root, _ = parse(dot(mlp, depth=0))
    assert root["m0"]["label"][:2] == ["(root) (TwoBlockMLP)", f"×{sum(c.module != '' for c in mlp.calls)} calls"]


def test_fold_repeats_draws_identical_blocks_once(mlp):
    nodes, edges = parse(dot(mlp, fold_repeats=True))
    text = dot(mlp, fold_repeats=True)
    assert 'label="blocks.0 (Block)\\n×2: blocks.0 … blocks.1"' in text
    for i, c in enumerate(mlp.calls):
        assert (f"c{i}" in nodes) == (not c.module.startswith("blocks.1")), c.name
    # The block's input comes from outside; its output leaves from the last copy.
    assert any(a["label"][0] == "input0" for _, _, a in edges if "label" in a)
    assert any(a["label"][0] == "add1:out" for _, _, a in edges if "label" in a)
    folded, _ = parse(dot(mlp, depth=2, fold_repeats=True))
    assert folded["m0"]["label"][-1] == "×2: blocks.0 … blocks.1"
    assert "blocks.1" not in " ".join(line for a in folded.values() for line in a["label"] if "…" not in line)


def test_fold_repeats_leaves_different_blocks_alone():
    t = mlp_trace(hidden=(8, 6))
    assert dot(t, fold_repeats=True) == dot(t)


def test_forward_only_and_backward_only(mlp):
    fwd, fwd_edges = parse(dot(mlp, backward=False))
    assert not [n for n in fwd if n.startswith(("g", "b", "mb"))]
    assert not [a for *_, a in fwd_edges if a.get("dir") == ["back"] or a.get("style") == ["dashed"]]
    assert len([n for n in fwd if re.fullmatch(r"c\d+", n)]) == len(mlp.calls)
    assert fwd[f"o{0}"]["label"][0] == "mean0:out"  # the loss has no consumer without backward
    bwd, _ = parse(dot(mlp, forward=False))
    assert not [n for n in bwd if re.fullmatch(r"[cs]\d+", n)]
    assert len([n for n in bwd if re.fullmatch(r"g\d+", n)]) == len(mlp.grad_nodes)
    with pytest.raises(ValueError, match="nothing to draw"):
        dot(mlp, forward=False, backward=False)


def test_same_program_same_text_and_saved_trace_renders_alike(tmp_trace):
    first = mlp_trace()
    assert dot(first) == dot(mlp_trace())
    first.save(tmp_trace)
    assert dot(tracer.load(tmp_trace)) == dot(first)


def test_custom_function_nesting_and_grad_node():
    t = function_trace()
    nodes, edges = parse(dot(t))
    names = [c.name for c in t.calls]
    outer, inner = f"c{names.index('ScaledMatmul0')}", f"c{names.index('Double0')}"
    assert nodes[outer]["label"] == ["ScaledMatmul0", "models.ScaledMatmul.apply"]
    text = dot(t)
    assert 'label="inside ScaledMatmul0"' in text and 'label="inside Double0"' in text
    node = f"g{[n.name for n in t.grad_nodes].index('ScaledMatmul0/ScaledMatmulBackward')}"
    assert (outer, node) in {(s, d) for s, d, a in edges if a.get("style") == ["dashed"]}
    # sum0 takes the Function's result from the Function, not from the matmul inside it
    assert any(s == outer and nodes[d]["label"][0] == "sum0" for s, d, _ in edges)
    assert inner in nodes


def test_nan_and_a_failed_call_are_red():
    with pytest.raises(RuntimeError), tracer.trace() as t:
        y = torch.tensor([-1.0, 2.0]).log() * 2
        torch.ones(2, 3) @ torch.ones(2, 3)
    del y
    nodes, edges = parse(dot(t))
    title = dot(t).splitlines()[3]
    assert "trace failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied" in title
    red = ["#dc2626"]
    nan_edge = next(a for s, d, a in edges if a.get("label", [""])[0] == "log0:out")
    assert nan_edge["label"][-1] == "NaN 1 Inf 0" and nan_edge["color"] == red
    matmul = nodes[f"c{[c.name for c in t.calls].index('matmul0')}"]
    assert matmul["color"] == red and matmul["label"][-1].startswith("raised: RuntimeError: mat1")
    assert "color" not in nodes["c0"]  # tensor0 / ones: nothing wrong, not red


# ---- files, rendering and hostile names --------------------------------------------------------
@needs_dot_program
def test_render_svg_and_png(mlp, tmp_path):
    text = dot(mlp, tmp_path / "g.svg")
    assert "linear0" in svg_texts(tmp_path / "g.svg")
    dot(mlp, tmp_path / "g.png", depth=1)
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert dot(mlp, tmp_path / "g.dot") == text == (tmp_path / "g.dot").read_text(encoding="utf-8")
    with pytest.raises(UserError, match=r"cannot write \.jpg"):
        dot(mlp, tmp_path / "g.jpg")


def test_missing_dot_program(mlp, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.fspath(tmp_path / "empty"))
    with pytest.raises(RenderError) as err:
        dot(mlp, tmp_path / "g.svg")
    assert str(err.value) == MISSING_DOT and isinstance(err.value, UserError)
    assert not (tmp_path / "g.svg").exists()
    dot(mlp, tmp_path / "g.dot")
    assert (tmp_path / "g.dot").read_text(encoding="utf-8").startswith("// Generated by gradtrace")


HOSTILE_MODULE = '</script>"\\'
HOSTILE_CLASS = 'Evil"\\\n<b>'


def hostile_trace() -> tracer.Trace:
    evil = type(HOSTILE_CLASS, (torch.autograd.Function,), {
        "__module__": "models",
        "forward": staticmethod(lambda ctx, x: x * 3),
        "backward": staticmethod(lambda ctx, g: g * 3)})

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add_module(HOSTILE_MODULE, nn.Linear(3, 3))

        def forward(self, x):
            return evil.apply(getattr(self, HOSTILE_MODULE)(x)).sum()

    torch.manual_seed(0)
    model = Model()
    with tracer.trace() as t:
        model(torch.randn(2, 3)).backward()
    return t


@needs_dot_program
def test_hostile_names_stay_text(tmp_path):
    t = hostile_trace()
    assert HOSTILE_MODULE in t.modules
    for options in ({}, {"depth": 1}):
        out = tmp_path / f"odd dir 'x\" <y>/g{len(options)}.svg"
        out.parent.mkdir(exist_ok=True)
        dot(t, out, **options)  # dot parses it, or this raises
        texts = svg_texts(out)
        assert f"{HOSTILE_MODULE} (Linear)" in texts
    texts = svg_texts(tmp_path / "odd dir 'x\" <y>/g0.svg")
    assert f"{HOSTILE_MODULE}.weight" in texts
    assert 'Evil"\\ <b>0' in texts  # the newline in the class name became a space, nothing else changed
    nodes, _ = parse(dot(t))
    assert [a["label"][0] for n, a in nodes.items() if n.startswith("s")][:2] == \
        [f"{HOSTILE_MODULE}.weight", f"{HOSTILE_MODULE}.bias"]


# ---- the command line --------------------------------------------------------------------------
@needs_dot_program
def test_cli_dot(mlp, tmp_path, capsys):
    trace_path = tmp_path / "step.gtrace"
    mlp.save(os.fspath(trace_path))
    assert main(["dot", os.fspath(trace_path)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'step.dot'}"
    assert (tmp_path / "step.dot").read_text(encoding="utf-8") == dot(mlp)
    out = tmp_path / "folded.svg"
    assert main(["dot", os.fspath(trace_path), "-o", os.fspath(out), "--depth", "1", "--fold-repeats",
                 "--forward-only", "--no-checksums"]) == 0
    assert "blocks (Sequential)" in svg_texts(out)
    assert main(["dot", os.fspath(trace_path), "-o", os.fspath(tmp_path / "b.dot"), "--backward-only"]) == 0
    assert (tmp_path / "b.dot").read_text(encoding="utf-8") == dot(mlp, forward=False)


def test_cli_errors_are_one_line(mlp, tmp_path, capsys, monkeypatch):
    trace_path = tmp_path / "step.gtrace"
    mlp.save(os.fspath(trace_path))
    capsys.readouterr()
    assert main(["dot", os.fspath(tmp_path / "nope.gtrace")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["dot", os.fspath(trace_path), "-o", os.fspath(tmp_path / "x.txt")]) == 2
    assert capsys.readouterr().err.startswith("gradtrace dot: error: cannot write .txt")
    monkeypatch.setenv("PATH", os.fspath(tmp_path / "empty"))
    assert main(["dot", os.fspath(trace_path), "-o", os.fspath(tmp_path / "x.svg")]) == 2
    assert capsys.readouterr().err == f"gradtrace dot: error: {MISSING_DOT}\n"
    with pytest.raises(SystemExit):
        main(["dot", os.fspath(trace_path), "--forward-only", "--backward-only"])
    with pytest.raises(SystemExit):
        main(["dot", os.fspath(trace_path), "--depth", "-1"])


# ---- backward_graph ----------------------------------------------------------------------------
def test_backward_graph_of_hf_model_output(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (2, 8))
    out = model(ids, labels=ids)
    text = backward_graph(out, tmp_path / "gpt2.dot", params=model)
    assert (tmp_path / "gpt2.dot").read_text(encoding="utf-8") == text
    nodes, edges = parse(text)
    assert nodes["r0"]["label"] == ["loss", "[] float32"]
    assert nodes["r1"]["label"] == ["logits", "[2, 8, 100] float32"]
    leaves = sorted(a["label"][0] for a in nodes.values() if a["label"][1:2] == ["AccumulateGrad"])
    assert leaves == sorted(name for name, _ in model.named_parameters())  # lm_head is tied to wte
    assert "transformer.h.0.attn.c_attn.weight" in leaves
    c_attn = next(a for a in nodes.values() if a["label"][0] == "transformer.h.0.attn.c_attn.weight")
    assert c_attn["label"][2] == "[32, 96] float32"

    # Every node PyTorch reaches from the roots is drawn once, every edge once.
    seen, stack, n_edges = set(), [out.loss.grad_fn, out.logits.grad_fn], 0
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None:
                n_edges += 1
                stack.append(nxt)
    assert len([n for n in nodes if re.fullmatch(r"n\d+", n)]) == len(seen)
    assert len([e for e in edges if e[0][0] in "nr" and not e[0].startswith("legend")]) == n_edges + 2
    assert backward_graph(out, params=dict(model.named_parameters())) == text


def test_backward_graph_holds_nothing_and_rejects_nothing_to_draw():
    torch.manual_seed(0)
    model = TwoBlockMLP()
    y = model(torch.randn(3, 4))
    ref = weakref.ref(y)
    text = backward_graph([y, (y.sum(), None)])
    assert '"output[0]\\n[3, 2] float32"' not in text and 'label="[0]\\n[3, 2] float32"' in text
    assert 'label="[1][0]\\n[] float32"' in text
    assert "(unnamed leaf)" in text
    del y
    gc.collect()
    assert ref() is None
    with pytest.raises(ValueError, match="no tensor with a grad_fn"):
        backward_graph({"x": torch.ones(2)})
    with pytest.raises(TypeError, match="params must be"):
        backward_graph(model(torch.randn(1, 4)), params=[1, 2])


def test_auto_depth_says_when_top_level_calls_leave_too_many_nodes():
    model = nn.Linear(4, 2)
    with tracer.trace(hash="none") as t:
        x = torch.randn(8, 4)
        for _ in range(60):  # data preparation at the top level: no module to fold it into
            x = x * 1.01 + 0.1
        model(x).sum().backward()
    from export.dot import fold

    g = fold.build(t, depth="auto")
    assert len(g.nodes) > fold.AUTO_NODES
    assert g.title[-1] == (f"still {len(g.nodes)} nodes, folded as far as modules go: 123 calls at the top level "
                           "(in no module below the root) cannot be folded (gradtrace report groups them)")
