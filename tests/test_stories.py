"""One true story of a bad step, on every surface (issue 42).

Eight planted bugs (tests/stories.py): a forward NaN from log of a negative; a custom attention
backward dividing 0/0 on a fully masked row beside intended -inf masks; the same under
clip_grad_norm_; AdamW with lr=nan; an fp16 GradScaler overflow (a skipped step, not a bug); an
EMA of the weights folded back into them with a NaN decay; a NaN arriving in the data batch; a
NaN in micro-batch 2 of gradient accumulation. For each, every surface names the same call, the
same user line, in the same words, with the phase right: ``t.anomalies``, ``raise_on_nonfinite``,
the warning, the text export, ``gradtrace summary``/``show``/``memory``, the diff, the notebook
card, the HTML report in a browser (banner, "first NaN", badges) and the watch under ``raise``
and ``skip``; ``gradtrace run --watch`` for two of them.
"""

from __future__ import annotations

import html
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

import tracer
from export.cli.main import main
from export.diff import diff
from export.text import to_text
from tests.stories import STORIES, Story
from tests.test_html_browser import browser, opened  # noqa: F401  (fixtures)
from tests.watch_models import checksum

ROOT = Path(__file__).resolve().parents[1]
IDS = [s.name for s in STORIES]
STORIES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stories.py")


def _traced(story: Story, **options: Any) -> tuple[tracer.Trace, list[warnings.WarningMessage]]:
    state = story.make()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with tracer.trace(hash="none", check_numerics=True, **options) as t:
            story.step(state)
    return t, [w for w in seen if issubclass(w.category, tracer.NumericsWarning)]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[tracer.Trace, list[Any], str]]:
    """Each story's step, traced once under check_numerics and saved."""
    out = {}
    folder = tmp_path_factory.mktemp("stories")
    for story in STORIES:
        t, seen = _traced(story, memory=True)
        path = str(folder / f"{story.name}.gtrace")
        t.save(path)
        out[story.name] = (t, seen, path)
    return out


def _expected_line(story: Story) -> str:
    with open(STORIES_FILE, encoding="utf-8") as fh:
        code = fh.read().splitlines()[story.line - 1].strip()
    return f"stories.py:{story.line}: {code}"


@pytest.mark.parametrize("story", STORIES, ids=IDS)
def test_the_report_tells_the_story(story: Story, traced: Any) -> None:
    t, _, _ = traced[story.name]
    report = t.anomalies
    h = report.headline
    assert h is not None
    assert (h.producer, h.phase, h.kind, h.arrived, h.node) == (story.producer, story.phase, story.kind, story.arrived,
                                                                story.node)
    assert h.line is not None and (h.line.file, h.line.line) == (STORIES_FILE, story.line)
    assert report.headline_text() == (report.skipped_step.headline() if story.skipped else h.headline())
    assert h.headline().endswith(" — " + _expected_line(story))
    if story.micro_batch is not None:
        assert (h.micro_batch, h.micro_batches) == story.micro_batch
        assert f"in {story.phase} (micro-batch 2 of 2)" in h.headline()
    # no intended Inf is a headline, nor counted among what the story reached
    assert h.tensor not in report.intended_values and not set(report.intended_values) & set(report.nonfinite_values)
    # the phase of the named call is the one the story says
    named = t.get(story.producer)
    if isinstance(named, tracer.Call):
        assert named.phase == story.phase
    # a NaN the story reached in the optimizer phase is not "forward" (the optimizer step, clipping)
    assert all(c.phase == "optimizer" for c in t.calls if c.kind == "optimizer")


def test_the_stories_read_exactly(traced: Any) -> None:
    """The headlines, word for word (the golden of docs/api.md's example is the first)."""
    def line(name: str) -> str:
        story = next(s for s in STORIES if s.name == name)
        return _expected_line(story)

    expected = {
        "log_negative": f"NaN made by log0 (torch.log) in forward, module <root> — {line('log_negative')}",
        "masked_backward": "NaN made by div1 (Tensor.div) in backward, in the backward of MaskedAttention0/"
                           f"MaskedAttentionBackward, module <root> — {line('masked_backward')}",
        "adamw_lr_nan": f"NaN made by AdamW0 (torch.optim.adamw.AdamW.step) in optimizer — {line('adamw_lr_nan')}",
        "grad_scaler_overflow": "GradScaler skipped the optimizer step: the scaled gradients overflowed, found at "
                                "_amp_foreach_non_finite_check_and_unscale_0 (loss scale 1.678e+07 -> 8.389e+06). "
                                "Not a bug: the scaler lowers the scale and goes on",
        "slow_weights_nan": f"NaN made by mul_0 (Tensor.mul_) in optimizer — {line('slow_weights_nan')}",
        "nan_batch": "NaN arrived from outside the step in input0, first read by linear0 "
                     f"(torch.nn.functional.linear) in forward, module 0 — {line('nan_batch')}",
        "accumulation_micro_batch_2": "NaN made by log1 (torch.log) in forward (micro-batch 2 of 2), module <root> — "
                                      f"{line('accumulation_micro_batch_2')}",
    }
    for name, text in expected.items():
        assert traced[name][0].anomalies.headline_text() == text, name
    clip = traced["clip_after_nan"][0].anomalies
    assert clip.headline_text() == traced["masked_backward"][0].anomalies.headline_text()
    # clipping carried the NaN on, in the optimizer phase: counted, never the headline
    assert clip.optimizer is not None and clip.optimizer.producer.startswith("_foreach_norm")
    assert not clip.optimizer.origin and clip.spread.by_phase["optimizer"] > 0
    assert clip.spread.line().startswith("then ") and " more values with NaN (backward 14, optimizer " in clip.spread.line()
    masked = traced["masked_backward"][0].anomalies
    assert masked.intended_inf == 3 and "3 values with an intended Inf (-inf masks), not a fault" in str(masked)


@pytest.mark.parametrize("story", STORIES, ids=IDS)
def test_the_warning_and_the_text_say_it(story: Story, traced: Any) -> None:
    t, seen, _ = traced[story.name]
    report = t.anomalies
    if story.skipped:
        assert seen == []  # a step the scaler skipped is not a fault: no warning
    else:
        assert [str(w.message) for w in seen] == [f"gradtrace: {report}"]
        assert str(seen[0].message).splitlines()[0] == f"gradtrace: {report.headline_text()}"
    text = to_text(t).splitlines()
    assert report.headline_text() in text


@pytest.mark.parametrize("story", STORIES, ids=IDS)
def test_raise_on_nonfinite_stops_with_the_same_words(story: Story) -> None:
    state = story.make()
    with pytest.raises(tracer.NonFiniteError) as info, tracer.check_numerics(raise_on_nonfinite=True):
        story.step(state)
    err = info.value
    assert err.anomaly.producer == story.producer and err.anomaly.phase == story.phase
    # the message leads with the headline (a skipped step cannot be told yet: documented, the
    # scaler's check comes later in the step)
    first = str(err).splitlines()[0]
    assert first == err.anomaly.headline() and first.endswith(_expected_line(story))
    # the traceback ends at the user's frames: of gradtrace's own, one frame, hidden from
    # pytest and IPython
    own = []
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(str(ROOT / "tracer")):
            own.append(tb.tb_frame)
        tb = tb.tb_next
    assert len(own) <= 1 and all(f.f_locals.get("__tracebackhide__") for f in own)


@pytest.mark.parametrize("story", STORIES, ids=IDS)
def test_summary_show_and_memory_say_it(story: Story, traced: Any, capsys: pytest.CaptureFixture[str]) -> None:
    t, _, path = traced[story.name]
    report = t.anomalies
    assert main(["summary", path]) == 0
    out = capsys.readouterr().out
    assert report.headline_text() in out
    # the NaN table lists what the story counts, the headline's value first; no intended Inf in it
    assert f"Values with NaN or unintended Inf ({len(report.nonfinite_values)} of" in out
    for name in report.intended_values:
        assert f"\n  {name} " not in out
    assert main(["show", path, story.producer]) == 0
    shown = capsys.readouterr().out
    assert f"numerics: the headline of this step — {report.headline_text()}" in shown
    assert main(["memory", path]) == 0
    assert report.headline_text() in capsys.readouterr().out
    if story.node is not None:
        assert main(["show", path, story.node]) == 0
        node = capsys.readouterr().out
        assert "calls its backward made" in node and f"{story.producer} " in node
        assert f"stories.py:{story.line}: ds = p * (dp - (dp * p).sum(-1, keepdim=True))" in node


@pytest.mark.parametrize("story", STORIES, ids=IDS)
def test_diff_and_the_notebook_card_say_it(story: Story, traced: Any, capsys: pytest.CaptureFixture[str]) -> None:
    t, _, _ = traced[story.name]
    report = t.anomalies
    said = html.escape(" ".join(report.headline_text().split()), quote=True)  # (HTML collapses spaces)
    assert said in t._repr_html_() and said in report._repr_html_()
    assert repr(report).startswith("<NumericsReport " + report.headline_text()[:60])
    result = diff(t, t, rtol=0.0, atol=0.0)  # (hash="none": compared by stats)
    from rich.console import Console
    result.render(Console(width=300, force_terminal=False))
    out = capsys.readouterr().out
    assert f"A: {report.headline_text()}" in out and f"B: {report.headline_text()}" in out


@pytest.mark.browser
@pytest.mark.parametrize("story", STORIES, ids=IDS)
def test_the_report_page_says_it(story: Story, traced: Any, opened: Any) -> None:  # noqa: F811
    t, _, _ = traced[story.name]
    report = t.anomalies
    o = opened(t, f"{story.name}.html")
    page = o.page
    assert page.text_content("#gt-story .story-head") == report.headline_text()
    assert ("warn" if story.skipped else "bad") in page.get_attribute("#gt-story", "class").split()
    button = page.locator("#gt-nan-first")
    assert button.text_content() == f"first {'NaN' if story.kind == 'nan' else 'Inf'}"
    assert button.get_attribute("data-target") == story.producer
    button.click()
    assert o.details_title() == story.producer
    # badges: NaN where the story counts a NaN, Inf where only an Inf, "mask" (grey) where only
    # an intended Inf; never NaN on an Inf-only box
    tags = page.eval_on_selector_all("#gt-vp .badtag, #gt-vp .masktag",
                                     "els => els.map(e => [e.closest('g').getAttribute('data-name'), e.textContent])")
    counted = set(report.nonfinite_values)
    for name, tag in tags:
        if name is None:  # a folded cluster
            continue
        rec = t.get(name)
        values = (rec.outputs if isinstance(rec, tracer.Call) else [*rec.grads_in, *rec.grads_out]) \
            if isinstance(rec, tracer.Call | tracer.GradNode) else []
        nan = any(v in counted and t.tensors[v].stats.nan for v in values if v in t.tensors)
        inf = any(v in counted and t.tensors[v].stats.inf for v in values if v in t.tensors)
        assert tag == ("NaN" if nan else "Inf" if inf else "mask"), (name, tag)
    if story.name == "masked_backward":
        assert ["masked_fill0", "mask"] in tags  # the intended mask: grey, not a fault
    assert o.errors == []


class _Records(logging.Handler):
    """The records of the gradtrace.watch logger (which does not propagate to the root's)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> list[logging.LogRecord]:
        logging.getLogger("gradtrace.watch").addHandler(self)
        return self.records

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("gradtrace.watch").removeHandler(self)


def _watched(story: Story, policy: str, tmp_path: Path) -> tuple[Any, Any]:
    state = story.make()
    step = tracer.watch(state.model, state.opt, out=str(tmp_path / "incident.gtrace"), policy=policy)(
        lambda: story.step(state))
    return state, step


@pytest.mark.parametrize("story", STORIES, ids=IDS)
def test_the_watch_under_raise_says_it_once(story: Story, traced: Any, tmp_path: Path) -> None:
    expected = traced[story.name][0].anomalies.headline_text()
    state, step = _watched(story, "raise", tmp_path)
    before = checksum(state.model, state.opt)
    with _Records() as records:
        if story.skipped:  # the scaler skipped the step: nothing tripped, nothing to say
            step()
            assert step.watch.incidents == [] and records == []
            return
        with pytest.raises(tracer.NonFiniteError) as info:
            step()
    err = info.value
    incident = err.incident
    assert err.anomaly.producer == story.producer and incident.anomaly.phase == story.phase
    message = str(err)
    assert expected in message and message.count(expected) == 1
    assert "parameters, buffers, optimizer state and random state restored to before step 0" in message
    assert checksum(state.model, state.opt) == before
    assert f"next: gradtrace show {incident.path} {story.producer}; open {incident.report}" in message
    assert records == []  # one message: the exception's
    # raised from the caller's frame: the watch's own frames are not in the traceback
    tb = err.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert not any(f.f_code.co_filename.startswith(str(ROOT / "tracer")) and not f.f_locals.get("__tracebackhide__")
                   for f in frames)
    # the incident file and the HTML report beside it
    assert incident.path.endswith("incident.step0.gtrace") and Path(incident.report).is_file()
    assert tracer.load(incident.path).anomalies.headline_text() == expected


@pytest.mark.parametrize("story", [s for s in STORIES if not s.skipped], ids=[s.name for s in STORIES if not s.skipped])
def test_the_watch_under_skip_logs_it_once(story: Story, traced: Any, tmp_path: Path) -> None:
    expected = traced[story.name][0].anomalies.headline_text()
    state, step = _watched(story, "skip", tmp_path)
    before = checksum(state.model, state.opt)
    with _Records() as records:
        step()
    assert checksum(state.model, state.opt) == before
    [record] = records
    assert expected in record.getMessage() and record.getMessage().count(expected) == 1
    assert "restored to before step 0" in record.getMessage() and "the run goes on from there (policy skip)" \
        in record.getMessage()


def test_gradtrace_run_watch_says_each_incident_once(tmp_path: Path) -> None:
    """Under `gradtrace run --watch`, a raised incident is printed once (the exception), and the
    closing line points at its files."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import tracer
        from tests.stories import STORIES
        for name in ("nan_batch", "masked_backward"):
            story = next(s for s in STORIES if s.name == name)
            state = story.make()
            step = tracer.watch(state.model, state.opt, out=name + ".gtrace", policy="skip")(lambda: story.step(state))
            step()
        """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tracer", "run", "--watch", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    for name in ("nan_batch", "masked_backward"):
        t = tracer.load(tmp_path / f"{name}.step0.gtrace")
        assert out.count(t.anomalies.headline_text()) == 1, name
        assert (tmp_path / f"{name}.step0.html").is_file()
    assert "gradtrace: step 0 tripped" in out
