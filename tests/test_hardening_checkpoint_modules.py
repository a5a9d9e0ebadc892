"""A call that activation checkpointing recomputes during the backward carries the module that
runs it, as its forward twin does (``torch.utils.checkpoint`` both ways, HF gradient
checkpointing both ways); a module is still never named from inside a backward."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tracer
from tests.models import hf_loss, hf_model


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Blocks(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x.pow(2).mean()


def _modules_of(t: tracer.Trace, phase: str, short: str) -> list[str]:
    return [c.module for c in t.calls if c.phase == phase and c.api.rsplit(".", 1)[-1] == short]


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputed_calls_of_a_small_model_carry_their_modules(reentrant: bool) -> None:
    model, x = Blocks(reentrant), torch.randn(4, 8, requires_grad=True)
    with tracer.trace(hash="none") as t:
        model(x).backward()
    assert _modules_of(t, "forward", "linear") == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    # The backward recomputes the last block first.
    assert _modules_of(t, "backward", "linear") == ["blocks.1.fc1", "blocks.1.fc2", "blocks.0.fc1", "blocks.0.fc2"]
    assert _modules_of(t, "backward", "tanh") == ["blocks.1", "blocks.0"]
    assert list(t.modules) == ["", "blocks", "blocks.0", "blocks.0.fc1", "blocks.0.fc2", "blocks.1", "blocks.1.fc1",
                               "blocks.1.fc2"]


PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_llama_recomputed_projections_carry_their_modules(reentrant: bool) -> None:
    model, x = hf_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (transformers renames the method)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with tracer.trace(hash="none") as t:
        hf_loss(model, x).backward()
    per_layer = [[f"model.layers.{i}.{p}" for p in PROJECTIONS] for i in range(2)]
    assert _modules_of(t, "forward", "linear") == per_layer[0] + per_layer[1] + ["lm_head"]
    assert _modules_of(t, "backward", "linear") == per_layer[1] + per_layer[0]


def test_a_module_first_called_in_a_backward_hook_is_not_named_there() -> None:
    """The module hooks' guard in backward stays: a module the forward never ran is passed by
    (its calls carry the running node's module), a module it ran carries its path."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    act = torch.nn.GELU()
    x = torch.randn(2, 4)
    seen: list[Any] = []
    with tracer.trace(hash="none") as t:
        h = model(x)
        h.register_hook(lambda g: seen.append(act(g) + model[1](g)))
        h.sum().backward()
    assert len(seen) == 1
    assert list(t.modules) == ["", "0", "1", "2"]
    assert [(c.name, c.module, c.phase) for c in t.calls if c.phase == "backward"] == [
        ("gelu0", "2", "backward"), ("tanh1", "1", "backward"), ("add0", "2", "backward")]


class BodyCheckpointed(torch.nn.Module):
    """Checkpoints its forward's body, not its __call__ (as transformers 5's
    GradientCheckpointingLayer does): the recomputation runs no hook of this module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._body, x, use_reentrant=False)


def test_a_checkpointed_body_recomputes_in_its_module_and_its_early_stop_is_no_error() -> None:
    model = torch.nn.Sequential(BodyCheckpointed(), BodyCheckpointed())
    x = torch.randn(4, 8, requires_grad=True)
    with tracer.trace(hash="none") as t:
        model(x).sum().backward()
    forward = [(c.api.rsplit(".", 1)[-1], c.module) for c in t.calls if c.phase == "forward"][:3]
    assert forward == [("linear", "0.fc"), ("tanh", "0"), ("add", "0")]
    recomputed = [(c.api.rsplit(".", 1)[-1], c.module) for c in t.calls if c.phase == "backward"]
    # The last block first; each recomputation stops (torch's early stop) at the last op it needs.
    assert recomputed == [("linear", "1.fc"), ("tanh", "1"), ("linear", "0.fc"), ("tanh", "0")]
    assert not [c.name for c in t.calls if c.error is not None]
    stop = [c for c in t.calls if c.phase == "backward" and not c.outputs]
    assert [c.api.rsplit(".", 1)[-1] for c in stop] == ["tanh", "tanh"]
    assert all(c.parent is not None and c.parent.endswith("Backward0") for c in t.calls if c.phase == "backward")


def test_a_module_no_root_holds_is_in_the_path_of_each_module_that_calls_it() -> None:
    # transformers 5 makes its rotary helpers global nn.Module objects, called from every layer.
    class Doubler(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    shared = Doubler()

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return shared(self.fc(x))

    model = torch.nn.Sequential(Layer(), Layer())
    with tracer.trace(hash="none") as t:
        model(torch.randn(2, 4)).sum().backward()
    assert [(c.name, c.module) for c in t.calls if c.api == "Tensor.mul"] == [("mul0", "0.<Doubler>"),
                                                                               ("mul1", "1.<Doubler>")]
    assert t.modules["0.<Doubler>"] == t.modules["1.<Doubler>"] == "Doubler"
    assert t["sum0"].module == ""  # the module stack unwound after each call of it
