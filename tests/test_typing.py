"""``tracer.trace``'s options are listed once (``tracer.options.TraceKwargs`` and the narrower
``RecordKwargs``, ``ReplayKwargs``; ``tracer.watch``'s ``WatchKwargs``), and every way in takes them
typed: a type checker refuses a misspelled option in ``tracer.trace``, ``record_memory``,
``tracer.watch`` and the framework callbacks alike."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest

import tracer
from tracer.features.watch import WatchKwargs
from tracer.options import OPTION_NAMES, RecordKwargs, ReplayKwargs, TraceKwargs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_typed_dicts_list_the_options_of_a_trace() -> None:
    assert TraceKwargs.__optional_keys__ == OPTION_NAMES and not TraceKwargs.__required_keys__
    assert RecordKwargs.__optional_keys__ == OPTION_NAMES - {"out"}
    assert ReplayKwargs.__optional_keys__ == OPTION_NAMES - {"out", "check_numerics"}
    watch_own = {p.name for p in inspect.signature(tracer.watch).parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert WatchKwargs.__optional_keys__ == ReplayKwargs.__optional_keys__ | watch_own


CALLS = textwrap.dedent("""\
    import torch
    import tracer
    from tracer.integrations.hf import TraceCallback
    from tracer.integrations.lightning import WatchCallback

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters())
    with tracer.trace(hash="fast", stacks=False, max_bytes=10, out="x.gtrace"):
        pass
    reveal_type(tracer.trace(steps="1", per_step_files=True, keep_values=["h.*"]))
    tracer.trace(hsah="md5")
    tracer.trace(steps="1", memroy=True)
    with tracer.record_memory(stcks=False):
        pass
    tracer.watch(model, opt, check_numerics=True)
    TraceCallback(steps="1", out="x.gtrace", hash="fast", mxa_calls=3)
    WatchCallback(policy="skip", hash="none", on="spike", stat=True)
    tracer.trace(hash="sha1")
    """)


def test_a_misspelled_option_is_a_type_error(tmp_path) -> None:
    """mypy (strict, the project's configuration) on calls with wrong option names: each is an
    error at its line. (Cheap once the project's own mypy run has filled .mypy_cache.)"""
    pytest.importorskip("mypy")
    calls = tmp_path / "calls.py"
    calls.write_text(CALLS)
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "pyproject.toml"),
                           "--no-error-summary", "--hide-error-context", os.fspath(calls)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT},
                          check=False)
    found = {(int(m[1]), m[2]) for m in re.finditer(r"calls\.py:(\d+): (?:error|note): (.*)", proc.stdout)}
    errors = {line: text for line, text in found if "Revealed type" not in text and "overload variant" not in text
              and not text.startswith(("Possible overload", "    def ", '"'))}
    assert errors == {
        11: 'Unexpected keyword argument "hsah" for overloaded function "trace"  [call-overload]',
        12: 'Unexpected keyword argument "memroy" for overloaded function "trace"; did you mean "memory"?  '
            "[call-overload]",
        13: 'Unexpected keyword argument "stcks" for "record_memory"; did you mean "stacks"?  [call-arg]',
        15: 'Unexpected keyword argument "check_numerics" for "watch"  [call-arg]',
        16: 'Unexpected keyword argument "mxa_calls" for "TraceCallback"; did you mean "max_calls"?  [call-arg]',
        17: 'Unexpected keyword argument "stat" for "WatchCallback"; did you mean "stats"?  [call-arg]',
    }, proc.stdout
    assert (10, 'Revealed type is "tracer.loops.steps.StepTrace"') in found
    assert any(line == 18 and "No overload variant" in text for line, text in found)  # hash="sha1"
    assert proc.returncode == 1
