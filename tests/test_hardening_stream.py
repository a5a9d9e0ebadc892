"""A streamed trace of a backward that starts nested backward runs (reentrant activation
checkpointing: each checkpointed region's backward recomputes its forward and runs a backward
of its own inside the outer one) holds exactly what ``t.save()`` writes, record for record,
however often it is flushed mid-backward: an outer run is never written while still open."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import export
import tracer
from tests.models import hf_loss, hf_model


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Checkpointed(torch.nn.Module):
    """An embedding (its node and accumulator run last, after both nested runs) and two blocks,
    each under a reentrant checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return h.pow(2).mean()


def _streamed_and_saved(tmp_path: Any, name: str, step: Any, flush_every: int) -> tuple[tracer.Trace, tracer.Trace]:
    """Trace ``step`` streamed to a file flushed every ``flush_every`` calls, save the live
    trace beside it; both loaded back."""
    streamed, saved = os.fspath(tmp_path / f"{name}.gtrace"), os.fspath(tmp_path / f"{name}.saved.gtrace")
    with tracer.trace(out=streamed, flush_every=flush_every) as t:
        step()
    t.save(saved)
    return tracer.load(streamed), tracer.load(saved)


def _nested_runs(t: tracer.Trace) -> list[str]:
    return [r.name for r in t.backward_runs if r.parent is not None]


@pytest.mark.parametrize("flush_every", [1, 3])
def test_a_small_model_streamed_equals_saved(tmp_path: Any, flush_every: int) -> None:
    model, ids = Checkpointed(), torch.tensor([1, 2, 3])
    streamed, saved = _streamed_and_saved(tmp_path, "small", lambda: model(ids).backward(), flush_every)
    assert _nested_runs(saved) == ["backward1", "backward2"]  # one nested run per checkpoint
    outer = saved.backward_runs[0]
    # The outer run ends with the embedding's node and its accumulator, after the nested runs.
    assert [s.node for s in outer.steps][-2:] == ["embedding0/EmbeddingBackward0", "emb.weight/AccumulateGrad"]
    assert [s.node for s in streamed.backward_runs[0].steps] == [s.node for s in outer.steps]
    assert list(streamed.records()) == list(saved.records())


def _llama_step() -> Any:
    torch.manual_seed(0)
    model, x = hf_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (transformers renames the method)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return lambda: hf_loss(model, x).backward()


def test_hf_llama_with_reentrant_checkpointing_streamed_equals_saved_and_runs_diff_equal(tmp_path: Any) -> None:
    runs = [_streamed_and_saved(tmp_path, f"llama{i}", _llama_step(), flush_every=2) for i in range(2)]
    for streamed, saved in runs:
        assert _nested_runs(saved) == ["backward1", "backward2"]  # one per decoder layer
        assert list(streamed.records()) == list(saved.records())
    (a, _), (b, _) = runs
    result = export.diff(a, b)
    assert result.equal, result.verdict()
