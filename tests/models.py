"""Small real models for tests: transformers from configs (no download), a CNN, nested Functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


def gpt2_12l() -> tuple[nn.Module, torch.Tensor]:
    """GPT-2's 12 layers at a tiny width (built from a config, no download), seeded, and a batch
    of token ids: the model the reading tests draw and report."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=12, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
    return model, torch.randint(0, 256, (2, 32))


def hf_model(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A tiny Hugging Face causal LM built from a config, and a batch of token ids."""
    import transformers as tf

    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
        model = tf.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=100, max_position_embeddings=32)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=100, max_position_embeddings=32,
                               num_local_experts=4, num_experts_per_tok=2)
        model = tf.MixtralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model.train()
    x = torch.randint(0, 100, (2, 8))
    return model, x


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class Scale(torch.autograd.Function):
    """Innermost: multiplies by a constant."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.k, None


class ScaledTanh(torch.autograd.Function):
    """Calls Scale.apply inside its forward and inside its backward (nesting both ways)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(Scale.apply(x, 2.0))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (y,) = ctx.saved_tensors
        return Scale.apply(g * (1 - y * y), 2.0)


class Outer(torch.autograd.Function):
    """A Function whose forward enables grad and builds a sub-graph with another Function."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return ScaledTanh.apply(x) + 1

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * 0.5


class NestedFnModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ScaledTanh.apply(self.a(x))
        h = Outer.apply(h)
        return self.b(h)


class MLP(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def hf_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def accumulated_scaled_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                            batches: list[torch.Tensor]) -> None:
    """The recipe step the tests trace: micro-batches accumulated under a GradScaler (each loss
    divided by their count), unscale, clipping to norm 1, the scaler's step and update."""
    for x in batches:
        scaler.scale(model(x).square().mean() / len(batches)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()



Recipe = Callable[[], tuple[nn.Module, Callable[[], None]]]


def traced_twin(recipe: Recipe, **trace_options: Any) -> tuple[nn.Module, nn.Module, Any]:
    """Run a recipe (a builder of a model and its step) twice from the same seeds, untraced and
    traced: the untraced model, the traced model and its trace."""
    import tracer

    torch.manual_seed(0)
    plain, step = recipe()
    torch.manual_seed(1)
    step()
    torch.manual_seed(0)
    model, step = recipe()
    torch.manual_seed(1)
    with tracer.trace(**trace_options) as t:
        step()
    return plain, model, t


def traced_sum_step(model: nn.Module, opt: torch.optim.Optimizer, shift: float = 0.0) -> Any:
    """One step of ``model`` on a fixed 3 x 4 input (plus ``shift``): the sum's backward and
    ``opt``'s step, traced with MD5s (the diff tests' runs that differ in one known way)."""
    import tracer

    x = torch.linspace(-1, 1, 12).view(3, 4) + shift
    with tracer.trace(hash="md5") as t:
        model(x).sum().backward()
        opt.step()
    return t


def saved(where: Any, traces: dict[str, Any]) -> dict[str, Any]:
    """Each trace saved as ``where/<name>.gtrace``; the paths by name."""
    out = {}
    for name, t in traces.items():
        out[name] = where / f"{name}.gtrace"
        t.save(str(out[name]))
    return out


def diff_output(capsys: Any, *argv: str) -> str:
    """What ``gradtrace diff ARGV`` prints for two traces that differ (exit status 1)."""
    from export.cli.main import main

    capsys.readouterr()
    assert main(["diff", *argv]) == 1
    return str(capsys.readouterr().out)

