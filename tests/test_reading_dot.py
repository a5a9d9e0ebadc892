"""The default DOT drawing is readable: the optimizer step is one node, folding picks a depth that
fits, repeated blocks are drawn once, and the rendered PNG of the demo and of a 12-layer GPT-2
stays within a screen-readable size at 100% zoom.

The demo's default drawing is a golden file (``checksums=False``: structure, not float bits);
GPT-2's is checked by node counts and size bounds, since its calls follow the installed
``transformers``.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess

import pytest
import torch

import tracer
from export.cli import main
from export.dot import dot
from export.dot.fold import AUTO_NODES, build
from tests.models import gpt2_12l as gpt2_12l_model
from tests.test_dot import check_golden, parse
from tracer.demo import build_demo, demo_step

needs_dot_program = pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot program")

# A PNG at Graphviz's 96 dpi with 10-point labels: wider than this cannot be read without
# scrolling across several screens (the drawing before this change was 32,767 px wide).
MAX_WIDTH = 3600
MAX_HEIGHT = 4500


def png_size(dot_text: str) -> tuple[int, int]:
    png = subprocess.run(["dot", "-Tpng"], input=dot_text.encode(), capture_output=True, check=True).stdout
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    return width, height


@pytest.fixture(scope="module")
def demo_trace() -> tracer.Trace:
    model, optimizer, batch = build_demo(seed=0)
    # Every node's run: the drawing labels the backward edges with the gradients they carried.
    with tracer.trace(hash="none", node_runs=True) as t:
        demo_step(model, optimizer, batch)
    return t


@pytest.fixture(scope="module")
def gpt2_12l() -> tracer.Trace:
    pytest.importorskip("transformers")
    model, ids = gpt2_12l_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tracer.trace(hash="none", node_runs=True) as t:
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    return t


def test_optimizer_step_is_one_node_fed_by_the_backward_run(demo_trace: tracer.Trace) -> None:
    nodes, edges = parse(dot(demo_trace, depth=None))
    step = [n for n, a in nodes.items() if a["label"][0].startswith("AdamW0")]
    assert len(step) == 1
    assert nodes[step[0]]["label"] == ["AdamW0: 28 params", "torch.optim.adamw.AdamW.step", "reads 28 grads"]
    assert nodes[step[0]]["shape"] == ["component"]
    into = [(s, a) for s, d, a in edges if d == step[0]]
    assert into == [("b0", into[0][1])] and into[0][1]["label"] == ["28 gradients"]
    # nothing the step writes (wte.weight@v1, exp_avg ...) is drawn; the parameters are, once each
    labels = [a["label"][0] for a in nodes.values()]
    assert not [x for x in labels if x.endswith("@v1") or ".exp_avg" in x]
    sources = [a["label"][0] for a in nodes.values() if a.get("shape") == ["invhouse"]]
    assert sources.count("wte.weight") == 1 and len(sources) == 28 + 2 + 1  # parameters, inputs, legend


def test_optimizer_detail_draws_every_tensor(demo_trace: tracer.Trace) -> None:
    nodes, _ = parse(dot(demo_trace, depth=None, optimizer_detail=True))
    labels = [a["label"][0] for a in nodes.values()]
    assert sum(x.endswith("@v1") for x in labels) == 28
    assert not any(x.startswith("AdamW0:") for x in labels)


def test_demo_default_drawing_golden(demo_trace: tracer.Trace, update_golden: bool) -> None:
    text = dot(demo_trace, checksums=False)
    check_golden("demo_default.dot", text, update_golden)
    assert "each module at depth 3 folded into one node; repeated blocks drawn once (chosen to fit" in text
    graph = build(demo_trace, depth="auto", checksums=False)
    assert len(graph.nodes) == 47 <= AUTO_NODES
    assert "×2: h.0 … h.1" in text


@needs_dot_program
def test_a_lean_trace_draws_the_same_backward_edges_unlabelled(demo_trace: tracer.Trace) -> None:
    """Without node runs (hash="none", node_runs unset) the backward graph is drawn alike, from
    the forward walk; only the gradients' names on its edges are missing."""
    model, optimizer, batch = build_demo(seed=0)
    with tracer.trace(hash="none") as lean:
        demo_step(model, optimizer, batch)
    edge = re.compile(r"^\s*(g\d+|mb\d+) -> (g\d+|mb\d+) \[(.*)\];$", re.M)
    full_edges = edge.findall(dot(demo_trace, checksums=False))
    lean_edges = edge.findall(dot(lean, checksums=False))
    assert [(a, b) for a, b, _ in lean_edges] == [(a, b) for a, b, _ in full_edges]
    assert any("label=" in attrs for _, _, attrs in full_edges)
    assert not any("@grad" in attrs or ":grad" in attrs for _, _, attrs in lean_edges)


def test_demo_default_png_is_readable(demo_trace: tracer.Trace) -> None:
    width, height = png_size(dot(demo_trace))
    assert width <= MAX_WIDTH and height <= MAX_HEIGHT, (width, height)
    full_width, _ = png_size(dot(demo_trace, depth=None, optimizer_detail=True))
    assert full_width > 2 * width  # what the default saves


@pytest.mark.slow
def test_gpt2_12_layers_default_drawing(gpt2_12l: tracer.Trace) -> None:
    graph = build(gpt2_12l, depth="auto")
    assert 30 <= len(graph.nodes) <= AUTO_NODES
    labels = [n.lines for n in graph.nodes.values()]
    (step,) = [x for x in labels if x[0].startswith("AdamW0")]
    assert step[0] == "AdamW0: 148 params"
    text = dot(gpt2_12l)
    assert text.count("×12: transformer.h.0 … transformer.h.11") >= 2  # the forward and backward box
    assert "transformer.h.5" not in text  # the 12 blocks are one box
    if shutil.which("dot"):
        width, height = png_size(text)
        assert width <= MAX_WIDTH and height <= MAX_HEIGHT, (width, height)


def test_auto_keeps_a_small_graph_whole() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with tracer.trace(hash="none") as t:
        model(torch.randn(2, 4)).sum().backward()
    assert dot(t) == dot(t, depth=None)
    assert "chosen to fit" not in dot(t)


def test_cli_depth_choices(tmp_path, capsys, demo_trace: tracer.Trace) -> None:
    path = tmp_path / "demo.gtrace"
    demo_trace.save(str(path))
    assert main(["dot", str(path), "-o", str(tmp_path / "a.dot")]) == 0
    assert (tmp_path / "a.dot").read_text(encoding="utf-8") == dot(demo_trace)
    assert main(["dot", str(path), "-o", str(tmp_path / "full.dot"), "--depth", "full", "--optimizer-detail"]) == 0
    assert (tmp_path / "full.dot").read_text(encoding="utf-8") == dot(demo_trace, depth=None, optimizer_detail=True)
    with pytest.raises(SystemExit) as exc:
        main(["dot", str(path), "--depth", "deep"])
    assert exc.value.code == 2
    assert "not auto, full or a whole number: 'deep'" in capsys.readouterr().err
