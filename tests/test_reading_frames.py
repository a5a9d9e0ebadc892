"""The user's line first: frames classed by path (tracer/model/frames.py), stacks folded in
``show``, ``describe()`` and the summary, every frame kept in the file (issue 20)."""

from __future__ import annotations

import asyncio
import os
import re
import sysconfig

import pytest
import torch
import transformers

import tracer
from export.cli.main import main
from export.html.data import build_payload
from tests.fresh_stack import on_a_fresh_stack
from tests.models import hf_model
from tracer.model.frames import fold_label, folded, frame_class, stack_lines

HERE = os.path.abspath(__file__)
SITE = sysconfig.get_paths()["purelib"]
STDLIB = sysconfig.get_paths()["stdlib"]


@pytest.mark.parametrize(("path", "cls"), [
    (HERE, "user"),
    ("/home/ana/project/train.py", "user"),
    ("<string>", "user"),
    ("/tmp/ipykernel_4242/1311357514.py", "user"),  # a Jupyter cell
    ("<ipython-input-3-5f8d2a>", "user"),
    (os.path.join(os.path.dirname(tracer.__file__), "demo.py"), "user"),  # the demo stands for the user's model
    (torch.nn.functional.__file__, "framework"),
    (tracer.__file__, "framework"),
    (os.path.join(os.path.dirname(os.path.dirname(tracer.__file__)), "export", "text.py"), "framework"),
    ("/opt/conda/lib/python3.10/site-packages/torch/nn/modules/module.py", "framework"),
    ("C:\\Python311\\Lib\\site-packages\\torch\\nn\\functional.py", "framework"),
    (transformers.__file__, "library"),
    (os.path.join(SITE, "_pytest", "python.py"), "library"),
    (os.path.join(STDLIB, "contextlib.py"), "library"),
    ("/usr/lib/python3.12/unittest/case.py", "library"),
    ("<frozen runpy>", "library"),
    ("/usr/lib/python3/dist-packages/numpy/core/fromnumeric.py", "library"),
    (asyncio.__file__, "kernel"),
    ("/usr/lib/python3.10/asyncio/events.py", "kernel"),
    ("/opt/conda/lib/python3.10/site-packages/ipykernel/kernelbase.py", "kernel"),
    ("/opt/conda/lib/python3.10/site-packages/IPython/core/interactiveshell.py", "kernel"),
    ("/opt/conda/lib/python3.10/site-packages/tornado/platform/asyncio.py", "kernel"),
    ("/usr/lib/python3/dist-packages/zmq/eventloop/zmqstream.py", "kernel"),
])
def test_frame_classes_are_exact_for_known_paths(path: str, cls: str) -> None:
    assert frame_class(path) == cls


@pytest.fixture(scope="module", name="gpt2_trace")
def gpt2_trace_fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[tracer.Trace, str]:
    return on_a_fresh_stack(gpt2_trace, tmp_path_factory)  # the same frames under any test runner


def gpt2_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[tracer.Trace, str]:
    torch.manual_seed(0)
    model, x = hf_model("gpt2")
    path = str(tmp_path_factory.mktemp("frames") / "gpt2.gtrace")
    with tracer.trace(out=path) as t:
        model(x, labels=x).loss.backward()  # the user's line
    return t, path


USER_LINE = "        model(x, labels=x).loss.backward()  # the user's line"


def _deep_call(t: tracer.Trace) -> tracer.Call:
    return next(c for c in t.calls if c.module == "transformer.h.1.mlp.act")


def test_a_call_deep_in_gpt2_shows_the_users_line_first(gpt2_trace: tuple[tracer.Trace, str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    t, path = gpt2_trace
    call = _deep_call(t)
    stack = call.stack
    user = [i for i, f in enumerate(stack) if frame_class(f.file) == "user"]
    assert [stack[i].line for i in user] == [gpt2_trace_line()]
    assert len(stack) > 10 and len(stack) - user[0] - 2 >= 5  # many frames of transformers below it
    assert main(["show", path, call.name]) == 0
    out = capsys.readouterr().out
    shown = out[out.index("Stack (most recent call last):"):].splitlines()
    inner = stack[-1]
    above, below = stack[:user[0]], stack[user[0] + 1:-1]
    assert shown == [
        "Stack (most recent call last):",
        f"  ... {fold_label(above)}",
        f'  File "{HERE}", line {gpt2_trace_line()}, in gpt2_trace',
        f"    {USER_LINE.strip()}",
        f"  ... {fold_label(below)}",
        f'  File "{inner.file}", line {inner.line}, in {inner.function}',
        f"    {inner.code}",
        f"({len(stack) - 2} frames folded: --all-frames shows every frame)",
    ]
    assert re.fullmatch(r"\d+ frames folded \(\d+ library\)", fold_label(below))
    assert frame_class(inner.file) == "library" and "transformers" in inner.file
    # --all-frames: every frame, as recorded; nothing was dropped from the file.
    assert main(["show", path, call.name, "--all-frames"]) == 0
    out = capsys.readouterr().out
    assert out.count('  File "') == len(stack)
    assert "folded" not in out
    assert folded(stack) == [i not in user and i != len(stack) - 1 for i in range(len(stack))]


def gpt2_trace_line() -> int:
    with open(HERE, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f].index(USER_LINE) + 1


def test_html_stack_payload_carries_each_frames_class(gpt2_trace: tuple[tracer.Trace, str]) -> None:
    t, _ = gpt2_trace
    payload = build_payload(t)
    classes = {row[0]: row[4] for row in payload["frames"]}
    assert classes[HERE] == "user"
    assert {classes[f.file] for f in _deep_call(t).stack} == {"user", "library"}


def test_a_notebook_stack_starts_at_the_cell() -> None:
    site = "/opt/conda/lib/python3.11/site-packages"
    frames = (
        tracer.Frame("/opt/conda/lib/python3.11/asyncio/base_events.py", 607, "BaseEventLoop.run_forever", "self._run_once()"),
        tracer.Frame(f"{site}/tornado/ioloop.py", 740, "IOLoop._run_callback", "ret = callback()"),
        tracer.Frame(f"{site}/ipykernel/kernelbase.py", 534, "Kernel.dispatch_queue", "await self.process_one()"),
        tracer.Frame(f"{site}/IPython/core/interactiveshell.py", 3577, "InteractiveShell.run_code", "exec(code_obj)"),
        tracer.Frame("/tmp/ipykernel_4242/1311357514.py", 3, "<module>", "loss = model(ids, labels=ids).loss"),
        tracer.Frame(f"{site}/transformers/models/gpt2/modeling_gpt2.py", 1066, "GPT2LMHeadModel.forward",
                     "transformer_outputs = self.transformer("),
        tracer.Frame(f"{site}/transformers/models/gpt2/modeling_gpt2.py", 310, "GPT2MLP.forward",
                     "hidden_states = self.act(hidden_states)"),
        tracer.Frame(f"{site}/transformers/activations.py", 66, "NewGELUActivation.forward",
                     "return 0.5 * input * (1.0 + torch.tanh(input))"),
    )
    assert [frame_class(f.file) for f in frames] == ["kernel"] * 4 + ["user"] + ["library"] * 3
    assert stack_lines(frames) == [
        "  ... 4 frames folded (4 notebook kernel)",
        '  File "/tmp/ipykernel_4242/1311357514.py", line 3, in <module>',
        "    loss = model(ids, labels=ids).loss",
        "  ... 2 frames folded (2 library)",
        f'  File "{site}/transformers/activations.py", line 66, in NewGELUActivation.forward',
        "    return 0.5 * input * (1.0 + torch.tanh(input))",
    ]
    assert len(stack_lines(frames, all_frames=True)) == 2 * len(frames)
    assert fold_label(frames[:1]) == "1 frame folded (1 notebook kernel)"


def test_a_dataclass_init_python_generated_is_not_the_users_line() -> None:
    import dataclasses

    from tracer.model import Frame
    from tracer.model.frames import is_user_frame, user_frame

    @dataclasses.dataclass
    class Result:
        loss: torch.Tensor

        def __post_init__(self) -> None:
            self.kept = self.loss.detach()  # the line of the call

    x = torch.randn(3, requires_grad=True)
    with tracer.trace() as t:
        Result(x.sum())
    stack = t["detach0"].stack
    # Python's generated __init__ is on the stack (a "<string>" file, as python -c's own code is).
    assert [f.file for f in stack if "__create_fn__" in f.function] == ["<string>"]
    line = user_frame(stack)
    assert line is not None and line.function.endswith("Result.__post_init__")
    assert line.code == "self.kept = self.loss.detach()  # the line of the call"
    # A library's dataclass: its generated __init__ is passed over for the caller's line;
    # python -c's code, also "<string>", stays the user's.
    lib = "/venv/lib/python3.11/site-packages/lib/__init__.py"
    frames = (Frame("/home/u/train.py", 8, "<module>", "r = lib.wrap(x)"), Frame(lib, 3, "wrap", "return Result(x)"),
              Frame("<string>", 4, "__create_fn__.<locals>.__init__", ""), Frame(lib, 9, "Result.__post_init__", ""))
    assert user_frame(frames) == frames[0]
    assert [is_user_frame(f) for f in frames] == [True, False, False, False]
    assert is_user_frame(Frame("<string>", 1, "<module>", ""))
