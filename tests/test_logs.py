"""Scoped logs (tracer.features.logs): levels, log_scope forward/backward lines, handlers, GRADTRACE_LOG.

Weights and inputs are small multiples of 1/2, so every value, statistic and MD5 below is exact
on any CPU.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

import tracer
from tracer.features.logs import (
    STATS,
    VALUES,
    ConsoleHandler,
    LogScope,
    apply_env,
    get_log_level,
    log_scope,
    parse_env,
    set_log_level,
)
from tracer.record.recorder import active_recorder


class Collect(logging.Handler):
    """Keeps (logger name, level, message) of every record."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))

    @property
    def lines(self) -> list[str]:
        return [m for _, _, m in self.records]


def _gradtrace_state() -> dict[str, tuple[int, bool, list[logging.Handler]]]:
    out = {}
    for name, lg in [("gradtrace", logging.getLogger("gradtrace")), *logging.root.manager.loggerDict.items()]:
        if isinstance(lg, logging.Logger) and (name == "gradtrace" or name.startswith("gradtrace.")):
            out[name] = (lg.level, lg.propagate, list(lg.handlers))
    return out


@pytest.fixture
def logs() -> Iterator[Collect]:
    """gradtrace loggers as the test found them afterwards; records collected instead of printed."""
    saved = _gradtrace_state()
    root = logging.getLogger("gradtrace")
    consoles = [h for h in root.handlers if isinstance(h, ConsoleHandler)]
    for h in consoles:
        root.removeHandler(h)
    collect = Collect()
    root.addHandler(collect)
    try:
        yield collect
    finally:
        root.removeHandler(collect)
        for name in _gradtrace_state():
            lg = logging.getLogger(name)
            level, propagate, handlers = saved.get(name, (logging.NOTSET, True, []))
            lg.setLevel(level)
            lg.propagate = propagate
            lg.handlers[:] = handlers


def halves(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=gen) / 2


def exact_linear(n_in: int, n_out: int, seed: int) -> nn.Linear:
    lin = nn.Linear(n_in, n_out)
    with torch.no_grad():
        lin.weight.copy_(halves(n_out, n_in, seed=seed))
        lin.bias.copy_(halves(n_out, seed=seed + 100))
    return lin


class ThreeBlocks(nn.Module):
    """Three blocks; ``forward`` runs the middle one inside whatever scope it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.a = exact_linear(4, 4, seed=1)
        self.b = nn.Sequential(exact_linear(4, 4, seed=2), nn.Tanh())
        self.c = exact_linear(4, 2, seed=3)

    def forward(self, x: torch.Tensor, scope: contextlib.AbstractContextManager) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with scope:
            h = self.b(h)
        return self.c(h)


def _fwd_bwd(lines: list[str]) -> tuple[list[str], list[str]]:
    return [m for m in lines if m.startswith("fwd")], [m for m in lines if m.startswith("bwd")]


# ---- acceptance: three blocks, the middle one in log_scope ------------------------------------------
def test_three_blocks_in_a_trace_log_only_the_middle_block_forward_and_backward(logs):
    model, x = ThreeBlocks(), halves(3, 4, seed=0)
    with tracer.trace() as t:
        scope = log_scope(level="DEBUG")
        loss = model(x, scope).pow(2).mean()
        n_during = len(logs.lines)
        loss.backward()  # outside the scope
    fwd, bwd = _fwd_bwd(logs.lines)
    assert n_during == len(fwd)  # every forward line was written while the block ran

    def ten(name: str) -> str:
        r = t.tensors[name]
        return f"{name} f32[{','.join(map(str, r.shape))}] md5:{r.md5[:8]}"

    assert fwd == [
        f"fwd     linear1 F.linear [b.0] ({ten('relu0:out')}, {ten('b.0.weight')}, {ten('b.0.bias')})"
        f" -> {ten('linear1:out')}",
        f"fwd     tanh0 torch.tanh [b.1] ({ten('linear1:out')}) -> {ten('tanh0:out')}",
    ]
    assert t["linear1"].module == "b.0" and t["tanh0"].module == "b.1"

    # Backward: only the middle block's nodes (and its parameters' accumulators), in the order
    # the engine ran them.
    ours = {"tanh0/TanhBackward0", "linear1/AddmmBackward0", "linear1/TBackward0",
            "b.0.bias/AccumulateGrad", "b.0.weight/AccumulateGrad"}
    assert set(scope.nodes) == ours
    order = [n for n in t.backward_runs[0].order if n in ours]
    assert order == ["tanh0/TanhBackward0", "linear1/AddmmBackward0", "b.0.bias/AccumulateGrad",
                     "linear1/TBackward0", "b.0.weight/AccumulateGrad"]
    g_add = "linear1/AddmmBackward0:grad2"
    assert bwd == [
        f"bwd>     tanh0/TanhBackward0 torch.tanh [b.1] received {ten('tanh0:out@grad')}",
        f"bwd<     tanh0/TanhBackward0 torch.tanh [b.1] produced {ten('linear1:out@grad')}",
        f"bwd>     linear1/AddmmBackward0 F.linear [b.0] received {ten('linear1:out@grad')}",
        f"bwd<     linear1/AddmmBackward0 F.linear [b.0] produced {ten('b.0.bias@grad')}, "
        f"{ten('relu0:out@grad')}, {ten(g_add)}",
        f"bwd>     b.0.bias/AccumulateGrad [b.0] received {ten('b.0.bias@grad')}",
        "bwd<     b.0.bias/AccumulateGrad [b.0]",
        f"bwd>     linear1/TBackward0 F.linear [b.0] received {ten(g_add)}",
        f"bwd<     linear1/TBackward0 F.linear [b.0] produced {ten('b.0.weight@grad')}",
        f"bwd>     b.0.weight/AccumulateGrad [b.0] received {ten('b.0.weight@grad')}",
        "bwd<     b.0.weight/AccumulateGrad [b.0]",
    ]
    assert {lv for _, lv, _ in logs.records} == {logging.DEBUG}
    assert {n for n, _, m in logs.records if m.startswith("bwd")} == {"gradtrace.backward"}


def test_three_blocks_without_a_trace_log_only_the_middle_block(logs):
    model, x = ThreeBlocks(), halves(3, 4, seed=0)
    scope = log_scope(level="DEBUG")
    loss = model(x, scope).pow(2).mean()
    assert active_recorder() is None  # the scope's own recorder is gone with the block
    fwd_during = list(logs.lines)
    loss.backward()
    fwd, bwd = _fwd_bwd(logs.lines)
    # The scope's recorder saw only the block: names count from its start, the first module it
    # entered (model.b) is named by its path in the model whose forward called it (b.0.weight).
    assert fwd == fwd_during == [
        "fwd     linear0 F.linear [b.0] (input0 f32[3,4], b.0.weight f32[4,4], b.0.bias f32[4]) -> linear0:out f32[3,4]",
        "fwd     tanh0 torch.tanh [b.1] (linear0:out f32[3,4]) -> tanh0:out f32[3,4]",
    ]
    assert bwd == [
        "bwd>     tanh0/TanhBackward0 torch.tanh [b.1] received f32[3,4]",
        "bwd<     tanh0/TanhBackward0 torch.tanh [b.1] produced f32[3,4]",
        "bwd>     linear0/AddmmBackward0 F.linear [b.0] received f32[3,4]",
        "bwd<     linear0/AddmmBackward0 F.linear [b.0] produced f32[4], f32[3,4], f32[4,4]",
        "bwd>     b.0.bias/AccumulateGrad [b.0] received f32[4]",
        "bwd<     b.0.bias/AccumulateGrad [b.0]",
        "bwd>     linear0/TBackward0 F.linear [b.0] received f32[4,4]",
        "bwd<     linear0/TBackward0 F.linear [b.0] produced f32[4,4]",
        "bwd>     b.0.weight/AccumulateGrad [b.0] received f32[4,4]",
        "bwd<     b.0.weight/AccumulateGrad [b.0]",
    ]
    assert set(scope.nodes) == {"tanh0/TanhBackward0", "linear0/AddmmBackward0", "linear0/TBackward0",
                                "b.0.bias/AccumulateGrad", "b.0.weight/AccumulateGrad"}


def test_backward_inside_the_scope_still_skips_nodes_created_before_it(logs):
    lin = exact_linear(2, 2, seed=4)
    with tracer.trace():
        y = lin(halves(1, 2, seed=5))
        with log_scope(level="INFO") as scope:
            z = y * 2
            z.sum().backward()
    assert scope.nodes == ["mul0/MulBackward0", "sum0/SumBackward0"]
    assert logs.lines == [
        "fwd mul0 Tensor.mul",
        "fwd sum0 Tensor.sum",
        "bwd> sum0/SumBackward0 Tensor.sum",
        "bwd< sum0/SumBackward0 Tensor.sum",
        "bwd> mul0/MulBackward0 Tensor.mul",
        "bwd< mul0/MulBackward0 Tensor.mul",
    ]


# ---- acceptance: levels restored exactly, also on exception -----------------------------------------
def test_levels_are_restored_exactly_after_the_scope_also_on_exception(logs):
    set_log_level({"*": "ERROR", "forward": 15, "memory": "STATS"})
    raw = {n: lv for n, (lv, _, _) in _gradtrace_state().items()}
    seen = get_log_level()
    assert seen == {"*": "ERROR", "forward": 15, "backward": "ERROR", "memory": "STATS"}
    with pytest.raises(RuntimeError, match="boom"), log_scope(level={"forward": "DEBUG", "backward": "INFO"}):
        assert get_log_level() == {"*": "ERROR", "forward": "DEBUG", "backward": "INFO", "memory": "STATS"}
        set_log_level("VALUES")  # changed inside the block: undone too
        assert get_log_level("memory") == "VALUES"
        raise RuntimeError("boom")
    assert {n: lv for n, (lv, _, _) in _gradtrace_state().items()} == raw
    assert get_log_level() == seen
    assert active_recorder() is None


def test_nested_scopes_restore_in_order_and_threads_may_close_out_of_order(logs):
    set_log_level("WARNING")
    with log_scope(level="INFO"):
        set_log_level({"memory": "DEBUG"})
        with log_scope(level="ERROR"):
            assert get_log_level("memory") == "ERROR"
        assert get_log_level() == {"*": "INFO", "forward": "INFO", "backward": "INFO", "memory": "DEBUG"}
    assert get_log_level() == {"*": "WARNING", "forward": "WARNING", "backward": "WARNING", "memory": "WARNING"}

    # Two threads whose scopes close in the order they opened (not nested): the last to close
    # puts back what was there before the first opened. ERROR scopes install nothing.
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def thread_a() -> None:
        with log_scope(level="ERROR"):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    seen: list[object] = []

    def thread_b() -> None:
        a_in.wait(5)
        with log_scope(level="CRITICAL"):
            b_in.set()
            a_out.wait(5)
            seen.append(get_log_level("*"))  # A closed first: B's levels still hold

    ts = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(10)
    assert seen == ["CRITICAL"]
    assert get_log_level("*") == "WARNING" and get_log_level("forward") == "WARNING"


# ---- acceptance: nested custom Functions are indented -------------------------------------------------
class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g * 2


class Shift(torch.autograd.Function):
    """Applies Scale inside its forward and inside its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return Scale.apply(x) + 1

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return Scale.apply(g)


class Wrap(torch.autograd.Function):
    """Applies Shift inside its forward: three levels of custom Functions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return Shift.apply(x).neg()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return Shift.apply(g).neg()


@pytest.mark.parametrize("traced", [True, False], ids=["trace", "no-trace"])
def test_nested_custom_functions_log_with_increasing_indentation(logs, traced):
    x = halves(2, 3, seed=6).requires_grad_()
    with tracer.trace(hash="none") if traced else contextlib.nullcontext():
        with log_scope(level="INFO"):
            y = Wrap.apply(x)
        y.sum().backward()
    fwd, bwd = _fwd_bwd(logs.lines)
    # A Function's own line comes when it returns, after the calls made inside it.
    assert fwd == [
        "fwd       mul0 Tensor.mul",
        "fwd     Scale0 Scale.apply",
        "fwd     add0 Tensor.add",
        "fwd   Shift0 Shift.apply",
        "fwd   neg0 Tensor.neg",
        "fwd Wrap0 Wrap.apply",
    ]
    indent = {m.split()[1]: len(m) - len(m[4:].lstrip()) - 4 for m in fwd}
    assert indent["mul0"] > indent["Scale0"] > indent["Shift0"] > indent["Wrap0"] == 0
    inside = ["bwd       mul1 Tensor.mul", "bwd     Scale1 Scale.apply", "bwd     add1 Tensor.add",
              "bwd   Shift1 Shift.apply", "bwd   neg1 Tensor.neg"] if traced else []
    # Inside a trace, the calls a node's backward makes (ops and Functions, nested as in forward)
    # show under that node.
    assert bwd == ["bwd> Wrap0/WrapBackward Wrap.apply", *inside, "bwd< Wrap0/WrapBackward Wrap.apply",
                   "bwd> input0/AccumulateGrad", "bwd< input0/AccumulateGrad"]


# ---- detail levels ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level, fwd, begin, end", [
    ("INFO", "fwd mul0 Tensor.mul", "bwd> mul0/MulBackward0 Tensor.mul", "bwd< mul0/MulBackward0 Tensor.mul"),
    ("DEBUG", "fwd mul0 Tensor.mul (input0 f32[2,2], 2) -> mul0:out f32[2,2]",
     "bwd> mul0/MulBackward0 Tensor.mul received f32[2,2]",
     "bwd< mul0/MulBackward0 Tensor.mul produced f32[2,2], -"),
    ("STATS", "fwd mul0 Tensor.mul (input0 f32[2,2], 2) -> mul0:out f32[2,2] {min=-4 max=8 mean=3 absmax=8}",
     "bwd> mul0/MulBackward0 Tensor.mul received f32[2,2] {min=0.5 max=0.5 mean=0.5 absmax=0.5}",
     "bwd< mul0/MulBackward0 Tensor.mul produced f32[2,2] {min=1 max=1 mean=1 absmax=1}, -"),
    ("VALUES", "fwd mul0 Tensor.mul (input0 f32[2,2], 2) -> mul0:out f32[2,2] {min=-4 max=8 mean=3 absmax=8} "
     "= [2, -4, 6, 8]",
     "bwd> mul0/MulBackward0 Tensor.mul received f32[2,2] {min=0.5 max=0.5 mean=0.5 absmax=0.5} "
     "= [0.5, 0.5, 0.5, 0.5]",
     "bwd< mul0/MulBackward0 Tensor.mul produced f32[2,2] {min=1 max=1 mean=1 absmax=1} = [1, 1, 1, 1], -"),
])
def test_levels_of_detail(logs, level, fwd, begin, end):
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], requires_grad=True)
    with log_scope(level=level):
        y = x * 2
    (y * 0.5).sum().backward()
    assert logs.lines[:3] == [fwd, begin, end]
    assert {lv for _, lv, _ in logs.records} == {getattr(logging, level, None) or {"STATS": STATS, "VALUES": VALUES}[level]}


def test_nan_and_inf_are_counted_and_names_and_checksums_come_from_the_trace(logs):
    with tracer.trace() as t:
        x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
        with log_scope(level="STATS", backward=False):
            y = x * 2
    md5 = t["mul0:out"].md5
    assert md5 is not None
    assert logs.lines == [f"fwd mul0 Tensor.mul (tensor0:out f32[4] md5:{t['tensor0:out'].md5[:8]}, 2) -> "
                          f"mul0:out f32[4] md5:{md5[:8]} {{min=-4 max=2 mean=-1 absmax=4 nan=1 inf=1}}"]
    del y


def test_parse_levels_and_components():
    from tracer.features.logs import parse_level

    assert [parse_level(v) for v in ("debug", "names", "shapes", "stats", "VALUES", "15", 7)] == [10, 20, 10, 7, 5, 15, 7]
    with pytest.raises(ValueError, match="not a log level: 'loud'"):
        parse_level("loud")
    with pytest.raises(ValueError, match="unknown log component 'fowrard'"):
        set_log_level({"fowrard": "DEBUG"})
    with pytest.raises(ValueError, match="unknown log component"):
        log_scope(level={"fowrard": "DEBUG"})


# ---- handlers -------------------------------------------------------------------------------------------------
def test_a_user_file_handler_gets_the_lines_unchanged(logs, tmp_path):
    path = tmp_path / "gradtrace.log"
    fh = logging.FileHandler(path, encoding="utf-8")
    fh.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("gradtrace").addHandler(fh)
    try:
        model, x = ThreeBlocks(), halves(3, 4, seed=0)
        model(x, log_scope(level="INFO")).sum().backward()
    finally:
        logging.getLogger("gradtrace").removeHandler(fh)
        fh.close()
    assert path.read_text(encoding="utf-8") == """\
INFO gradtrace.forward: fwd     linear0 F.linear [b.0]
INFO gradtrace.forward: fwd     tanh0 torch.tanh [b.1]
INFO gradtrace.backward: bwd>     tanh0/TanhBackward0 torch.tanh [b.1]
INFO gradtrace.backward: bwd<     tanh0/TanhBackward0 torch.tanh [b.1]
INFO gradtrace.backward: bwd>     linear0/AddmmBackward0 F.linear [b.0]
INFO gradtrace.backward: bwd<     linear0/AddmmBackward0 F.linear [b.0]
INFO gradtrace.backward: bwd>     b.0.bias/AccumulateGrad [b.0]
INFO gradtrace.backward: bwd<     b.0.bias/AccumulateGrad [b.0]
INFO gradtrace.backward: bwd>     linear0/TBackward0 F.linear [b.0]
INFO gradtrace.backward: bwd<     linear0/TBackward0 F.linear [b.0]
INFO gradtrace.backward: bwd>     b.0.weight/AccumulateGrad [b.0]
INFO gradtrace.backward: bwd<     b.0.weight/AccumulateGrad [b.0]
"""
    assert logs.lines == [line.split(": ", 1)[1] for line in path.read_text(encoding="utf-8").splitlines()]


def test_console_handler_aligns_columns_and_wraps_at_a_fixed_width(logs):
    out = io.StringIO()
    handler = ConsoleHandler(stream=out, width=100, color=False)
    logging.getLogger("gradtrace").addHandler(handler)
    try:
        model, x = ThreeBlocks(), halves(3, 4, seed=0)
        model(x, log_scope(level="DEBUG")).sum().backward()
    finally:
        logging.getLogger("gradtrace").removeHandler(handler)
    assert out.getvalue() == """\
fwd      linear0                  F.linear       [b.0] (input0 f32[3,4], b.0.weight f32[4,4],
                                                       b.0.bias f32[4]) -> linear0:out f32[3,4]
fwd      tanh0                    torch.tanh     [b.1] (linear0:out f32[3,4]) -> tanh0:out f32[3,4]
bwd>     tanh0/TanhBackward0      torch.tanh     [b.1] received f32[3,4]
bwd<     tanh0/TanhBackward0      torch.tanh     [b.1] produced f32[3,4]
bwd>     linear0/AddmmBackward0   F.linear       [b.0] received f32[3,4]
bwd<     linear0/AddmmBackward0   F.linear       [b.0] produced f32[4], f32[3,4], f32[4,4]
bwd>     b.0.bias/AccumulateGrad                 [b.0] received f32[4]
bwd<     b.0.bias/AccumulateGrad                 [b.0]
bwd>     linear0/TBackward0       F.linear       [b.0] received f32[4,4]
bwd<     linear0/TBackward0       F.linear       [b.0] produced f32[4,4]
bwd>     b.0.weight/AccumulateGrad                [b.0] received f32[4,4]
bwd<     b.0.weight/AccumulateGrad                [b.0]
"""


def test_console_handler_is_plain_off_a_terminal_and_coloured_when_asked(logs):
    plain, coloured = io.StringIO(), io.StringIO()
    handlers = [ConsoleHandler(stream=plain), ConsoleHandler(stream=coloured, color=True)]
    for h in handlers:
        logging.getLogger("gradtrace").addHandler(h)
    try:
        with log_scope(level="INFO", backward=False):
            torch.ones(2).neg()
        logging.getLogger("gradtrace.memory").warning("pool at %d%%", 93)
    finally:
        for h in handlers:
            logging.getLogger("gradtrace").removeHandler(h)
    assert plain.getvalue() == (
        "fwd  ones0                        torch.ones\n"
        "fwd  neg0                         Tensor.neg\n"
        "warning gradtrace.memory: pool at 93%\n")
    assert "\x1b[" in coloured.getvalue()
    assert "\x1b[" not in plain.getvalue()


# ---- torch's own logs, scoped --------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["+dynamo", {"dynamo": "DEBUG"}], ids=["string", "dict"])
def test_torch_logs_are_scoped_and_restored(logs, spec, monkeypatch):
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    dynamo = logging.getLogger("torch._dynamo")
    before = (dynamo.level, dynamo.propagate, list(dynamo.handlers))
    with log_scope(level="WARNING", torch_logs=spec):
        assert dynamo.getEffectiveLevel() == logging.DEBUG
    assert (dynamo.level, dynamo.propagate, list(dynamo.handlers)) == before


# ---- GRADTRACE_LOG ------------------------------------------------------------------------------------------
def test_gradtrace_log_environment_variable(logs):
    assert parse_env("forward=DEBUG, backward=INFO") == {"forward": "DEBUG", "backward": "INFO"}
    assert parse_env("DEBUG") == {"*": "DEBUG"}
    assert parse_env("*=WARNING,memory=stats") == {"*": "WARNING", "memory": "stats"}
    apply_env("*=ERROR,forward=DEBUG,backward=INFO")
    assert get_log_level() == {"*": "ERROR", "forward": "DEBUG", "backward": "INFO", "memory": "ERROR"}
    with pytest.warns(RuntimeWarning, match="GRADTRACE_LOG='forward=LOUD' ignored: not a log level"):
        apply_env("forward=LOUD")
    assert get_log_level("forward") == "DEBUG"


def test_gradtrace_log_is_read_on_import():
    code = "import tracer.features.logs as l; print(sorted(l.get_log_level().items()))"
    env = {**os.environ, "GRADTRACE_LOG": "forward=DEBUG,backward=INFO"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == ("[('*', 'WARNING'), ('backward', 'INFO'), ('forward', 'DEBUG'), "
                                  "('memory', 'WARNING')]")


# ---- global levels, cost when disabled, safety ---------------------------------------------------------------
def test_global_levels_log_every_traced_call(logs):
    with tracer.trace(hash="none") as t:
        set_log_level({"forward": "INFO"})
        x = torch.ones(2, requires_grad=True)
        (x * 3).sum().backward()
    assert logs.lines == ["fwd ones0 torch.ones", "fwd mul0 Tensor.mul", "fwd sum0 Tensor.sum"]
    set_log_level({"forward": "WARNING", "backward": "INFO"})
    with tracer.trace(hash="none") as t:
        from tracer.features.logs import attach_if_enabled

        attach_if_enabled(active_recorder())  # what trace() does when it starts
        x = torch.ones(2, requires_grad=True)
        (x * 3).sum().backward()
    assert logs.lines[3:] == [f"bwd> {n}" if i % 2 == 0 else f"bwd< {n}"
                              for n in ["sum0/SumBackward0 Tensor.sum", "mul0/MulBackward0 Tensor.mul",
                                        "ones0:out/AccumulateGrad"] for i in (0, 1)]
    assert t.backward_runs[0].order == ["sum0/SumBackward0", "mul0/MulBackward0", "ones0:out/AccumulateGrad"]


def test_a_disabled_scope_installs_nothing(logs):
    from torch.overrides import _get_current_function_mode_stack

    modes = len(_get_current_function_mode_stack())
    with log_scope(level="WARNING") as scope:
        assert active_recorder() is None
        assert len(_get_current_function_mode_stack()) == modes
        (torch.ones(2, requires_grad=True) * 2).sum().backward()
    assert scope.nodes == [] and logs.lines == []
    with tracer.trace():
        rec = active_recorder()
        with log_scope(level={"forward": "ERROR", "backward": "ERROR"}):
            assert rec is not None and rec.listeners == []


def test_trace_inside_a_scope_without_a_trace_is_refused_clearly(logs):
    with pytest.raises(tracer.TraceError, match=r"Put `with tracer.trace\(\):` outside `with tracer.log_scope\(\):`"), \
            log_scope(level="INFO"), tracer.trace():
        pass
    assert active_recorder() is None


def test_no_tensor_is_kept_alive_and_close_stops_the_backward_lines(logs):
    x = torch.ones(3, requires_grad=True)
    with log_scope(level="INFO") as scope:
        y = x * 2
        z = y.exp()
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None  # the node hooks hold names, not tensors
    scope.close()
    z.sum().backward()
    assert [m for m in logs.lines if m.startswith("bwd")] == []
    assert scope.nodes == []


def test_backward_on_another_thread_logs_the_scope_nodes(logs):
    x = torch.ones(2, requires_grad=True)
    with log_scope(level="INFO"):
        y = (x * 2).sum()
    th = threading.Thread(target=y.backward)
    th.start()
    th.join(10)
    assert [m for m in logs.lines if m.startswith("bwd")] == [
        "bwd> sum0/SumBackward0 Tensor.sum", "bwd< sum0/SumBackward0 Tensor.sum",
        "bwd> mul0/MulBackward0 Tensor.mul", "bwd< mul0/MulBackward0 Tensor.mul",
        "bwd> input0/AccumulateGrad", "bwd< input0/AccumulateGrad"]


def test_a_scope_on_another_thread_than_the_trace_is_refused(logs):
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with log_scope(level="INFO"):
                pass
        except tracer.TraceError as exc:
            errors.append(exc)

    with tracer.trace():
        th = threading.Thread(target=other)
        th.start()
        th.join(10)
    assert len(errors) == 1 and "another thread is being traced" in str(errors[0])
    assert isinstance(log_scope(), LogScope)


def test_a_scope_without_a_trace_leaves_no_hooks_on_the_parameters_accumulators(logs):
    # A parameter's accumulator outlives the scope's graph (the next graph through the parameter
    # reuses it): the scope's hooks on it went with nothing, and every later backward logged it.
    lin = exact_linear(4, 4, seed=1)
    x = halves(2, 4, seed=2)
    for _ in range(3):
        seen = len(logs.lines)
        with log_scope(level="DEBUG"):
            y = lin(x)
        y.sum().backward()
        assert [m for m in logs.lines[seen:] if m.startswith("bwd<") and "AccumulateGrad" in m] == [
            "bwd< bias/AccumulateGrad", "bwd< weight/AccumulateGrad"]
    seen = len(logs.lines)
    lin(x).sum().backward()  # outside any scope
    assert logs.lines[seen:] == []


@pytest.mark.parametrize("hash_kind", ["none", "md5"])
def test_scoped_blocks_in_a_trace_log_the_accumulators_every_time(logs, hash_kind):
    # A parameter's accumulator is one node for the whole trace: a scope after an unscoped use
    # of the parameter logged it no more.
    lin = exact_linear(4, 4, seed=1)
    x = halves(2, 4, seed=2)
    logged, listed = [], []
    with tracer.trace(hash=hash_kind):
        for scoped in (True, True, False, True):
            seen = len(logs.lines)
            if scoped:
                with log_scope(level="INFO") as scope:
                    loss = lin(x).sum()
                listed.append(sorted(n for n in scope.nodes if n.endswith("AccumulateGrad")))
            else:
                loss = lin(x).sum()
            loss.backward()
            logged.append(sum("AccumulateGrad" in m for m in logs.lines[seen:]))
    assert logged == [4, 4, 0, 4]
    assert listed == [["bias/AccumulateGrad", "weight/AccumulateGrad"]] * 3
