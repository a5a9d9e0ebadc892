"""Where ``export.diff`` says two runs first differ, on pairs whose difference is known: a
backward hook that changes a gradient (a tensor's, a parameter's, a module's), gradients the
engine sums from two edges, runs of different lengths or cut short, one model run with other
batch shapes, and the verdict's words for what is equal."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import export
import tracer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.fc, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.hook, self.scale = "", 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = self.a(x)
        h = torch.tanh(x0)
        if self.hook == "tensor":
            h.register_hook(lambda g: g * self.scale)
        return self.b(torch.tanh(self.fc(h + x0)))  # (x0's gradient is summed from two edges)


def _traced(tmp_path: Path, name: str, hook: str, scale: float) -> Path:
    torch.manual_seed(0)
    model = Net()
    model.hook, model.scale = hook, scale
    if hook == "param":
        model.fc.weight.register_hook(lambda g: g * scale)
    if hook == "module":
        model.fc.register_full_backward_hook(lambda mod, gi, go: (gi[0] * scale,))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    with tracer.trace(hash="md5") as t:
        nn.functional.cross_entropy(model(x), y).backward()
    path = tmp_path / f"{name}.gtrace"
    t.save(path)
    return path


@pytest.mark.parametrize(("hook", "node"), [("tensor", "tanh0/TanhBackward0"), ("param", "fc.weight/AccumulateGrad"),
                                            ("module", "BackwardHookFunction0/BackwardHookFunctionBackward")])
def test_a_hook_that_changes_a_gradient_is_the_backward_origin(tmp_path: Path, hook: str, node: str) -> None:
    r = export.diff(_traced(tmp_path, "a", hook, 1.0), _traced(tmp_path, "b", hook, 1.5))
    assert r.forward.origin is None
    origin = r.backward.origin
    assert origin is not None and origin.a == "mul0"
    # (the hook's factor is its call's argument: the difference the trace knows is named)
    assert origin.note.startswith(f"mul0 in a backward hook of {node}: inputs match, arguments differ "
                                  "('1.0' vs '1.5'), outputs differ")
    assert r.backward.independent == [] and "nondeterministic" not in r.verdict()


def test_gradients_summed_from_two_edges_are_not_new_origins(tmp_path: Path) -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.l1(x)
            x = x + self.l2(x)
            return self.head(x)

    paths = []
    for i in range(2):
        torch.manual_seed(0)
        model = Residual()
        if i:
            with torch.no_grad():  # one ulp in one weight of the last residual layer
                model.l2.weight[0, 0] = torch.nextafter(model.l2.weight[0, 0], torch.tensor(1.0))
        with tracer.trace(hash="md5") as t:
            model(torch.randn(4, 8)).pow(2).mean().backward()
        paths.append(tmp_path / f"{i}.gtrace")
        t.save(paths[-1])
    r = export.diff(*paths)
    assert r.forward.origin is not None and r.forward.origin.a == "linear1"  # the first reader of l2.weight
    assert r.backward.origin is not None and r.backward.origin.a == "pow0/PowBackward0"
    assert r.backward.independent == []
    assert [row.a for row in r.backward.rows if row.status == "new"] == []


def _steps(tmp_path: Path, name: str, steps: int, **options: Any) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with tracer.trace(hash="md5", **options) as t:
        for _ in range(steps):
            model(x).mean().backward()
            opt.step()
            opt.zero_grad()
    path = tmp_path / f"{name}.gtrace"
    t.save(path)
    return path


def test_runs_of_different_lengths_compare_the_parameters_after_the_common_steps(tmp_path: Path) -> None:
    r = export.diff(_steps(tmp_path, "two", 2), _steps(tmp_path, "one", 1))
    assert all(p.updated is not None and p.updated.status == "equal" for p in r.params)
    assert "A made 2 optimizer steps, B 1: each parameter is compared after step 1, the last both made" in r.notes


def test_a_run_cut_short_by_max_calls_says_so(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the stop's own warning)
        cut = _steps(tmp_path, "cut", 1, max_calls=3)
    r = export.diff(_steps(tmp_path, "full", 1), cut)
    assert any(n.startswith("B: recording stopped at max_calls=3") for n in r.notes)


def test_one_model_run_with_other_micro_batches_is_not_called_another_program(tmp_path: Path) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    paths = []
    for k in (2, 4):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()) for _ in range(4)],
                              nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with tracer.trace(hash="md5") as t:
            for xs, ys in zip(x.chunk(k), y.chunk(k)):
                (nn.functional.cross_entropy(model(xs), ys) / k).backward()
            opt.step()
        paths.append(tmp_path / f"{k}.gtrace")
        t.save(paths[-1])
    r = export.diff(*paths)
    assert "different models or programs" not in r.verdict()
    assert any("18 of 18 parameters match by name and shape" in n for n in r.forward.notes)
    assert all(p.value.status == "equal" for p in r.params)


def test_an_empty_trace_and_equal_values_in_words(tmp_path: Path) -> None:
    full = _steps(tmp_path, "full", 1)
    with tracer.trace(hash="md5") as t:
        pass
    t.save(tmp_path / "empty.gtrace")
    assert export.diff(full, tmp_path / "empty.gtrace").verdict().startswith(
        "DIVERGED — B recorded no forward calls (")
    # An equal parameter has no "difference" to describe; an empty tensor is equal within a tolerance.
    r = export.diff(full, _steps(tmp_path, "again", 1))
    assert all(p.value.describe() == "" and p.to_json()["value"]["difference"] is None for p in r.params)
    with tracer.trace(hash="md5") as t1:
        torch.tensor([], dtype=torch.float32) + 1
    with tracer.trace(hash="md5") as t2:
        torch.tensor([], dtype=torch.bfloat16) + 1
    assert export.diff(t1, t2, rtol=0.05, atol=0.05).equal


def test_a_numpy_index_is_recorded_by_value_and_named_as_the_difference() -> None:
    import numpy as np

    traces = []
    for i in (3, 5):  # (a row picked by the program: siamese_network's unseeded random index)
        with tracer.trace(hash="md5") as t:
            x = torch.arange(10.0) * 2
            x[np.int64(i)] * np.float32(0.5)
        traces.append(t)
    assert [c.args for c in traces[0].calls][-2:] == ["3", "0.5"]
    r = export.diff(*traces)
    assert r.forward.origin is not None and r.forward.origin.a == "getitem0"
    assert r.forward.origin.note == "inputs match, arguments differ ('3' vs '5'), outputs differ"
