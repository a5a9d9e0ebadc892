"""Where a run of inserted or removed work goes when repeated work could hold it at several
places (export/diff/align.py): B's extra micro-batch, at the end or at the start of a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tracer
from export.diff import diff
from export.diff.align import Pair, align

torch.set_num_threads(1)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 8, generator=g) for _ in range(3)]


def _accumulate(order: list[int], path: Path) -> Path:
    """One optimizer step over the micro-batches ``order`` (indices into _batches())."""
    xs = _batches()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace() as t:
        for k in order:
            model(xs[k]).pow(2).mean().backward()
        opt.step()
    t.save(path)
    return path




def _micro_batch(k: int) -> list[str]:
    """The forward calls' names of the k-th micro-batch (two linears per micro-batch)."""
    return [f"linear{2 * k}", f"relu{k}", f"linear{2 * k + 1}", f"pow{k}", f"mean{k}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("micro")
    return {"two": _accumulate([0, 1], d / "two.gtrace"),
            "three": _accumulate([0, 1, 2], d / "three.gtrace"),
            "first": _accumulate([2, 0, 1], d / "first.gtrace")}


def test_an_extra_micro_batch_at_the_end_is_inserted_at_the_end(runs: dict[str, Path]) -> None:
    r = diff(runs["two"], runs["three"])
    inserted = [row.b for row in r.forward.rows if row.a is None]
    assert inserted == _micro_batch(2)
    # The two micro-batches both ran pair with each other, name for name, and are equal.
    paired = [(row.a, row.b) for row in r.forward.rows if row.a is not None and row.b is not None]
    assert paired[:10] == [(n, n) for n in _micro_batch(0) + _micro_batch(1)]
    assert r.forward.origin is None or not r.forward.origin.startswith("linear")
    assert "backward run backward2 is only in B" in r.backward.notes
    assert next(row.b for row in r.backward.rows if row.a is None) == "mean2/MeanBackward0"
    assert not [row for row in r.backward.rows if row.a is not None and row.b is not None and row.a != row.b]
    # What differs is what the third micro-batch added to: every gradient, then every value.
    assert len(r.params) == 4 and all(p.grad is not None for p in r.params)


def test_an_extra_micro_batch_at_the_start_is_found_there_by_its_checksums(runs: dict[str, Path]) -> None:
    r = diff(runs["two"], runs["first"])
    inserted = [row.b for row in r.forward.rows if row.a is None]
    assert inserted == _micro_batch(0)  # B's first micro-batch read the batch A never read
    paired = [(row.a, row.b) for row in r.forward.rows if row.a is not None and row.b is not None]
    assert paired[:10] == list(zip(_micro_batch(0) + _micro_batch(1), _micro_batch(1) + _micro_batch(2)))
    assert "backward run backward0 is only in B" in r.backward.notes


def test_a_missing_micro_batch_is_removed_at_the_end(runs: dict[str, Path]) -> None:
    r = diff(runs["three"], runs["two"])
    assert [row.a for row in r.forward.rows if row.b is None] == _micro_batch(2)
    assert "backward run backward2 is only in A" in r.backward.notes


def test_without_content_an_inserted_repeat_goes_last() -> None:
    a = ["x", "y", "x", "y", "step"]
    b = ["x", "y", "x", "y", "x", "y", "step"]
    rows = align(a, b)
    assert rows == [Pair(0, 0), Pair(1, 1), Pair(2, 2), Pair(3, 3), Pair(None, 4), Pair(None, 5), Pair(4, 6)]
    # and a removed one, the same way
    assert align(b, a) == [Pair(0, 0), Pair(1, 1), Pair(2, 2), Pair(3, 3), Pair(4, None), Pair(5, None), Pair(6, 4)]


def test_content_places_an_inserted_repeat_where_the_pairs_agree() -> None:
    a = ["x", "x", "step"]
    b = ["x", "x", "x", "step"]
    # A's two x's read what B's first and third read: B's second is the one inserted.
    same = {(0, 0), (1, 2), (2, 3)}
    rows = align(a, b, lambda i, j: int((i, j) in same))
    assert rows == [Pair(0, 0), Pair(None, 1), Pair(1, 2), Pair(2, 3)]


def test_an_insertion_between_unlike_calls_stays_put() -> None:
    a = ["load", "x", "step"]
    b = ["load", "y", "x", "step"]
    assert align(a, b) == [Pair(0, 0), Pair(None, 1), Pair(1, 2), Pair(2, 3)]
