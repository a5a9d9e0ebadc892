"""The HTML stack panel folds library frames behind a toggle (issue 20), in headless chromium."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tracer
from tests import test_html_browser as shared
from tests.fresh_stack import on_a_fresh_stack
from tests.models import hf_model
from tracer.model.frames import frame_class

pytestmark = shared.pytestmark
browser = shared.browser  # the module's fixtures, shared
opened = shared.opened


@pytest.fixture(scope="module", name="gpt2")
def gpt2_fixture() -> tracer.Trace:
    return on_a_fresh_stack(gpt2)  # the same frames under any test runner


def gpt2() -> tracer.Trace:
    torch.manual_seed(0)
    model, x = hf_model("gpt2")
    with tracer.trace() as t:
        model(x, labels=x).loss.backward()  # the user's line in the panel
    return t


def test_stack_panel_shows_the_users_line_and_folds_the_rest(opened: Any, gpt2: tracer.Trace) -> None:
    call = next(c for c in gpt2.calls if c.module == "transformer.h.1.mlp.act")
    o = opened(gpt2)
    page = o.page
    page.click("#gt-search")
    page.keyboard.type(call.name)
    page.keyboard.press("Enter")
    assert o.details_title() == call.name
    stack = call.stack
    user = [f for f in stack if frame_class(f.file) == "user"]
    visible = page.locator("#gt-details .stack > .frame").all_inner_texts()
    assert len(visible) == len(user) + 1
    assert "model(x, labels=x).loss.backward()  # the user's line in the panel" in visible[0]
    assert stack[-1].code in visible[-1]
    toggles = page.locator("#gt-details .stack > .fold-toggle")
    labels = toggles.all_inner_texts()
    assert len(labels) == 2 and all(t.startswith("▸ ") and "library" in t for t in labels)
    hidden = sum(int(t.split()[1]) for t in labels)
    assert hidden == len(stack) - len(visible)
    assert page.locator("#gt-details .stack .folded .frame").count() == hidden
    assert not page.locator("#gt-details .stack .folded .frame").first.is_visible()
    toggles.nth(1).click()
    assert page.locator("#gt-details .stack .folded").nth(1).locator(".frame").first.is_visible()
    assert toggles.nth(1).inner_text().startswith("▾ ")
    assert o.errors == []
