"""``export.render``: the view a path's extension names, the same bytes as the renderer's own."""

from __future__ import annotations

import pytest
import torch

import export
import tracer
from export.errors import UserError


def test_render_picks_the_view_by_extension(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    with tracer.trace() as t:
        model(torch.randn(2, 4)).sum().backward()
    export.render(t, tmp_path / "a.html")
    export.html(t, tmp_path / "b.html")
    assert (tmp_path / "a.html").read_bytes() == (tmp_path / "b.html").read_bytes()
    export.render(t, tmp_path / "a.DOT")
    assert (tmp_path / "a.DOT").read_text(encoding="utf-8") == export.dot(t)
    export.render(t, tmp_path / "a.txt")
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == export.to_text(t)
    with pytest.raises(UserError, match=r"cannot write \.jpg"):
        export.render(t, tmp_path / "a.jpg")
    assert not (tmp_path / "a.jpg").exists()
