"""Names are unique within a kind, not across kinds (issue 45, item 7): a parameter a module holds
as ``linear0`` is the tensor ``linear0`` beside the call ``linear0``; a buffer ``backward0``
beside the backward run. ``kind:name`` names one record everywhere a name is looked up
(``t[...]``, ``gradtrace show``, the report's search); a bare name several kinds share is
refused with the spellings of each, never silently one of them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracer
from export.cli import main
from tracer.model import BackwardRun, Call, GradNode, TensorRecord


class Clashing(nn.Module):
    """A parameter and a buffer whose names are also a call's and a backward run's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear0 = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("backward0", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.linear0) * self.backward0


@pytest.fixture(scope="module")
def clash() -> tracer.Trace:
    model = Clashing()
    x = torch.randn(3, 4)
    with tracer.trace() as t:
        model(x).sum().backward()
    return t


@pytest.fixture(scope="module")
def saved(clash: tracer.Trace, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("names") / "clash.gtrace")
    clash.save(path)
    return path


def test_the_recording_has_the_clashes_this_file_is_about(clash: tracer.Trace) -> None:
    assert clash.kinds_of("linear0") == ["call", "tensor"]
    assert clash.kinds_of("backward0") == ["tensor", "backward"]
    assert clash.kinds_of("linear0:out") == ["tensor"]


@pytest.mark.parametrize("loaded", [False, True], ids=["live", "loaded"])
def test_a_qualified_name_reaches_each_record(clash: tracer.Trace, saved: str, loaded: bool) -> None:
    t = tracer.load(saved) if loaded else clash
    param = t["tensor:linear0"]
    assert isinstance(param, TensorRecord) and param.role == "param" and tuple(param.shape) == (4, 4)
    call = t["call:linear0"]
    assert isinstance(call, Call) and call.api == "torch.nn.functional.linear"
    assert call.inputs == ["input0", "linear0"]   # the call reads the parameter of its own name
    buffer = t["tensor:backward0"]
    assert isinstance(buffer, TensorRecord) and buffer.role == "buffer"
    run = t["backward:backward0"]
    assert isinstance(run, BackwardRun) and run.api == "Tensor.backward"
    node = t[f"node:{call.grad_nodes[0]}"]
    assert isinstance(node, GradNode) and node.call == "linear0"
    # a name one kind has needs no qualifier, and takes one
    assert t["linear0:out"] is t["tensor:linear0:out"]
    assert t["sum0"] is t["call:sum0"]


@pytest.mark.parametrize(("name", "spellings"), [
    ("linear0", "'linear0' names a call and a tensor in this trace: say which one, call:linear0, tensor:linear0"),
    ("backward0", "'backward0' names a tensor and a backward run in this trace: say which one, "
                  "tensor:backward0, backward:backward0"),
])
def test_a_bare_name_of_two_kinds_is_refused_with_both_spellings(clash: tracer.Trace, name: str,
                                                                   spellings: str) -> None:
    with pytest.raises(KeyError) as err:
        clash[name]
    assert err.value.args[0] == spellings
    assert name in clash


def test_get_never_raises_and_prefers_the_producer(clash: tracer.Trace) -> None:
    """``get`` is the look-up of links (a tensor's producer is a call, a node or a run): where a
    bare name has several kinds it gives the call, else the run; a qualified name, that one."""
    assert isinstance(clash.get("linear0"), Call)
    assert isinstance(clash.get("backward0"), BackwardRun)
    assert isinstance(clash.get("tensor:linear0"), TensorRecord)
    assert isinstance(clash.get("tensor:backward0"), TensorRecord)
    assert clash.get("tensor:nothing") is None and clash.get("nothing") is None
    assert "tensor:linear0" in clash and "call:linear0:out" not in clash


def test_an_unknown_qualified_name_suggests_names_of_its_kind(clash: tracer.Trace) -> None:
    with pytest.raises(KeyError) as err:
        clash["tensor:linear9"]
    message = err.value.args[0]
    assert message.startswith("no tensor named 'linear9' in this trace; did you mean ")
    assert "tensor:linear0" in message and "call:linear0" not in message


# ---- gradtrace show ----------------------------------------------------------------------------------
def _show(capsys: pytest.CaptureFixture[str], path: str, name: str) -> tuple[int, str, str]:
    rc = main(["show", path, name])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_show_refuses_an_ambiguous_name_and_shows_each_qualified_one(saved: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _show(capsys, saved, "linear0")
    assert (rc, out) == (2, "")
    assert err.strip() == ("gradtrace show: error: 'linear0' names a call and a tensor in this trace: "
                           "say which one, call:linear0, tensor:linear0")
    rc, out, err = _show(capsys, saved, "tensor:linear0")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "tensor linear0"
    assert any(line.split() == ["role", "param"] for line in lines)
    rc, out, _ = _show(capsys, saved, "call:linear0")
    assert rc == 0 and out.splitlines()[0] == "call linear0"
    assert any(line.split() == ["api", "torch.nn.functional.linear"] for line in out.splitlines())
    rc, out, _ = _show(capsys, saved, "backward:backward0")
    assert rc == 0 and out.splitlines()[0] == "backward run backward0"
    rc, out, _ = _show(capsys, saved, "tensor:backward0")
    assert rc == 0 and out.splitlines()[0] == "tensor backward0"


# ---- the report's search -------------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"


@pytest.mark.browser
@pytest.mark.skipif(not (os.path.exists(CHROMIUM) or shutil.which("chromium")), reason="needs Debian's chromium")
class TestReportSearch:
    """The HTML report in headless chromium, as tests/test_html_browser.py drives it."""

    @pytest.fixture
    def page(self, clash: tracer.Trace, tmp_path: Path) -> Any:
        sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright")
        from tests import test_html_browser as shared  # its page helper (imported once playwright is there)

        path = tmp_path / "clash.html"
        shared.write_html(clash, path)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shared.CHROMIUM, headless=True, args=shared.ARGS)
            opened = shared.Opened(browser, path)
            yield opened
            assert opened.errors == []
            browser.close()

    @staticmethod
    def search(o: Any, text: str) -> list[tuple[str, str, str]]:
        o.page.fill("#gt-search", "")
        o.page.click("#gt-search")
        o.page.keyboard.type(text)
        return [(r.get_attribute("data-kind") or "", r.get_attribute("data-name") or "", r.inner_text())
                for r in o.page.locator("#gt-results .result").all()]

    def test_a_shared_name_lists_each_kind_by_its_qualified_spelling(self, page: Any) -> None:
        rows = self.search(page, "linear0")
        note = rows[0]
        assert note[:2] == ("", "")
        assert note[2] == "\u201clinear0\u201d names a call and a tensor: type call:linear0 or tensor:linear0 " \
                          "(Enter opens the first below)"
        exact = [(kind, name) for kind, name, text in rows[1:3]]
        assert exact == [("call", "linear0"), ("tensor", "linear0")]
        assert "call:linear0" in rows[1][2] and "tensor:linear0" in rows[2][2]
        page.page.keyboard.press("ArrowDown")
        page.page.keyboard.press("Enter")
        assert page.details_title() == "linear0"
        assert page.page.inner_text("#gt-details .badge").startswith("tensor")

    def test_a_qualified_query_finds_that_kind_only(self, page: Any) -> None:
        rows = self.search(page, "tensor:linear0")
        assert rows[0][:2] == ("tensor", "linear0")
        assert {kind for kind, _, _ in rows} == {"tensor"}
        page.page.keyboard.press("Enter")
        assert page.details_title() == "linear0"
        assert page.page.inner_text("#gt-details .badge").startswith("tensor")
        rows = self.search(page, "call:linear0")
        assert rows[0][:2] == ("call", "linear0")
        page.page.keyboard.press("Enter")
        assert page.details_title() == "linear0"
        assert page.page.inner_text("#gt-details .badge") == "call"
        rows = self.search(page, "backward:backward0")
        assert rows[0][:2] == ("backward", "backward0")
        page.page.keyboard.press("Enter")
        assert "Backward run backward0" in (page.page.text_content("#gt-details") or "")   # (the panel listing the runs)

    def test_a_tensor_link_opens_the_tensor_not_the_call_of_its_name(self, page: Any) -> None:
        self.search(page, "call:linear0")
        page.page.keyboard.press("Enter")
        page.page.click('#gt-details [data-goto="tensor:linear0"]')
        assert page.details_title() == "linear0"
        assert page.page.inner_text("#gt-details .badge").startswith("tensor")
