"""Warnings raised inside a traced op point at the user's line, as they do without gradtrace
(tracer/record/warning_sites.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import tracer


def _resize_warning() -> None:
    torch.add(torch.ones(3), torch.ones(3), out=torch.empty(1))  # C++ TORCH_WARN (stacklevel 1)


def _softmax_warning() -> None:
    F.softmax(torch.ones(2, 3))  # Python warnings.warn(stacklevel=3) inside torch


def _caught(fn: object) -> list[tuple[str, int, type[Warning], str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()  # type: ignore[operator]
    return [(w.filename, w.lineno, w.category, str(w.message)) for w in seen]


@pytest.mark.parametrize("fn", [_resize_warning, _softmax_warning])
def test_warning_inside_a_traced_op_points_at_the_users_line(fn: object) -> None:
    untraced = _caught(fn)
    with tracer.trace():
        traced = _caught(fn)
    assert len(untraced) == 1
    assert traced == untraced
    assert traced[0][0] == __file__
    assert traced[0][1] == fn.__code__.co_firstlineno + 1  # type: ignore[attr-defined]


def test_filters_and_registry_see_the_users_module(tmp_path: object) -> None:
    # Without catch_warnings: the default filters show a UserWarning once per location, and a
    # filter on the user's module applies; both must behave as without gradtrace.
    script = textwrap.dedent("""
        import warnings, torch, tracer
        warnings.filterwarnings("error", message="Implicit dimension", module="__main__")
        with tracer.trace():
            for _ in range(3):
                torch.add(torch.ones(3), torch.ones(3), out=torch.empty(1))
            try:
                torch.nn.functional.softmax(torch.ones(2, 3))
            except UserWarning as exc:
                print("raised:", str(exc)[:30])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "raised: Implicit dimension choice for \n"
    lines = [line for line in proc.stderr.splitlines() if "UserWarning" in line]
    assert len(lines) == 1  # once for the location, not three times
    assert lines[0].startswith("<string>:6: UserWarning: An output with one or more elements was resized")


def test_the_numerics_warning_points_at_the_users_with_line() -> None:
    x = torch.tensor([-1.0, 4.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        with tracer.check_numerics():
            torch.sqrt(x)
    found = [w for w in caught if w.category is tracer.NumericsWarning]
    assert [(w.filename, w.lineno) for w in found] == [(__file__, line)]


def test_a_warning_shows_once_across_traced_steps() -> None:
    # Each trace used to add and remove a warnings filter, which resets every module's
    # once-per-location registry: a deprecation warning of a module the program calls
    # (nn.Dropout2d on 2-D input) printed again at every traced step.
    script = textwrap.dedent("""
        import torch, tracer
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout2d(0.5))
        for _ in range(3):
            with tracer.trace(hash="none"):
                model(torch.randn(2, 4)).sum().backward()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sum("UserWarning: dropout2d" in line for line in proc.stderr.splitlines()) == 1
