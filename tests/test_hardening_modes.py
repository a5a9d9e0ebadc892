"""gradtrace's own tensor work is invisible to a program's modes (issue 45, item 5).

A ``TorchFunctionMode`` the program entered before the trace sits below gradtrace's recording
mode: it saw gradtrace's own reads (version counters, shapes, checksums, fingerprints: 128 calls
of a small step became 259, 477 under ``hash="fast"``). The default device is such a mode too:
under ``torch.set_default_device("meta")`` the fingerprint's work buffers were made on the meta
device, and no tensor of the process got a fingerprint again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import tracer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Counting(TorchFunctionMode):
    """A program's own mode: the name of every torch function it is handed, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        owner = getattr(func, "__self__", None)  # an attribute's getter or setter: which attribute
        if name.startswith("getset_descriptor."):
            name += f" {getattr(owner, '__name__', '?')}"
        self.seen.append(name)
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.fc(x)).relu()


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """A training step: forward through two blocks and a head, backward, clipping, AdamW."""
    loss = model(x).pow(2).mean()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def seen_by_the_program(traced: dict[str, Any] | None) -> list[str]:
    """What a program's mode entered before the step sees of the step's second run (the first
    made the optimizer's state), traced with these options or not at all."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    step(model, opt, x)
    with Counting() as mode:
        if traced is None:
            step(model, opt, x)
        else:
            with tracer.trace(**traced):
                step(model, opt, x)
    return mode.seen


@pytest.fixture(scope="module")
def untraced() -> list[str]:
    return seen_by_the_program(None)


@pytest.mark.parametrize("options", [{"hash": "md5"}, {"hash": "fast"}, {"hash": "none"},
                                     {"hash": "none", "check_numerics": True}],
                         ids=["md5", "fast", "none", "check_numerics"])
def test_a_program_mode_sees_the_same_calls_traced_or_not(untraced: list[str], options: dict[str, Any]) -> None:
    assert {"linear", "Tensor.backward", "getset_descriptor.__get__ grad"} <= set(untraced)   # (the step's own)
    assert seen_by_the_program(options) == untraced


# ---- the default device ------------------------------------------------------------------------------
# In a fresh process: gradtrace's work buffers are cached for the process, so the first trace of
# the process is the one under the meta device.
META_SCRIPT = textwrap.dedent("""
    import json
    import torch
    import tracer

    def record(where, hash):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(32, 64)

        def step():
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

        if where == "set_default_device":
            torch.set_default_device("meta")
            try:
                with tracer.trace(hash=hash) as t:
                    step()
            finally:
                torch.set_default_device(None)
        elif where == "with torch.device":
            with torch.device("meta"):
                with tracer.trace(hash=hash) as t:
                    step()
        else:
            with tracer.trace(hash=hash) as t:
                step()
        return {n: [r.fingerprint or r.md5, r.hash_note, repr(r.stats)] for n, r in t.tensors.items()}

    runs = [("with torch.device", "fast"), ("set_default_device", "fast"), ("set_default_device", "md5"),
            ("none", "fast"), ("none", "md5")]
    print(json.dumps({f"{where} {hash}": record(where, hash) for where, hash in runs}))
""")


def test_fingerprints_under_a_meta_default_device_are_those_without_it() -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", META_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    for hash in ("fast", "md5"):
        plain = got[f"none {hash}"]
        assert len(plain) >= 30 and all(v[0] is not None and v[1] is None for v in plain.values())
    assert got["with torch.device fast"] == got["none fast"]
    assert got["set_default_device fast"] == got["none fast"]
    assert got["set_default_device md5"] == got["none md5"]
