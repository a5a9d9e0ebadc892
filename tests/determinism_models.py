"""Steps that are not deterministic on purpose, for ``tracer.check_determinism`` and
``gradtrace run --check-determinism``: a scatter-add whose rows are added in an order that
changes at every call (what atomic adds do on a GPU, made to happen on the CPU), used in a
forward pass and inside a custom ``autograd.Function``'s backward; and on CUDA the real thing,
``index_add_`` of repeated indices.

The markers (``# ND-...``) let the tests find the exact line a report must name."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import torch

# The order changes at every call, and between processes (atomics do not repeat across runs either).
_calls = itertools.count(int.from_bytes(os.urandom(4), "little"))


@torch.library.custom_op("gradtrace_tests::scrambled_add", mutates_args=())
def scrambled_add(base: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``base.index_add(0, index, src)`` with the rows added one by one in an order that changes
    at every call, as atomic adds land: with repeated indices the float sums round differently."""
    out = base.clone()
    order = torch.randperm(index.numel(), generator=torch.Generator().manual_seed(next(_calls))).tolist()
    for i in order:
        out[index[i]] += src[i]
    return out


@scrambled_add.register_fake
def _(base: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(base)


def _setup(ctx: object, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.index = inputs[1]  # type: ignore[attr-defined]


def _backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
    return grad, None, grad[ctx.index]  # type: ignore[attr-defined]  (as index_add's)


scrambled_add.register_autograd(_backward, setup_context=_setup)


class GatherRows(torch.autograd.Function):
    """``table[index]`` whose backward sums the gradients of repeated rows with a scatter-add
    that is not deterministic (``scatter``: ``scrambled_add`` on the CPU, ``index_add_`` on CUDA)."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.rows = table.shape[0]
        return table[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        zero = grad.new_zeros((ctx.rows, grad.shape[1]))
        if grad.is_cuda:
            return zero.index_add_(0, index, grad), None  # ND-CUDA-BACKWARD
        return scrambled_add(zero, index, grad), None  # ND-CPU-BACKWARD


def rows_model(device: str = "cpu", rows: int = 4, width: int = 64, n: int = 400) -> tuple[
        torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A table of rows read with repeated indices, a linear head, SGD; the indices and a per-row scale
    (so that the repeated rows' gradients differ and their sum's rounding depends on the order)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"table": torch.nn.Embedding(rows, width), "head": torch.nn.Linear(width, 1)}).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    index = (torch.arange(n) * 7 % rows).to(device)
    scale = torch.linspace(0.1, 3.0, n, device=device)[:, None]
    return model, opt, index, scale


def custom_backward_step(model: torch.nn.Module, opt: torch.optim.Optimizer, index: torch.Tensor,
                         scale: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A step whose only nondeterminism is in a custom Function's backward."""
    def step() -> torch.Tensor:
        h = GatherRows.apply(model["table"].weight, index)
        loss = model["head"](h * scale).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def forward_step(model: torch.nn.Module, opt: torch.optim.Optimizer, index: torch.Tensor,
                 scale: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A step whose forward sums repeated rows with a scatter-add that is not deterministic."""
    def step() -> torch.Tensor:
        src = model["table"].weight[index] * scale
        zero = torch.zeros_like(model["table"].weight)
        if src.is_cuda:  # noqa: SIM108  (one line per case: the reports name it)
            summed = zero.index_add(0, index, src)  # ND-CUDA-FORWARD
        else:
            summed = scrambled_add(zero, index, src)  # ND-CPU-FORWARD
        loss = model["head"](summed).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, index: torch.Tensor,
               scale: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The same model trained with built-in, deterministic ops only."""
    def step() -> torch.Tensor:
        loss = model["head"](model["table"](index) * scale).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def line_of(marker: str) -> int:
    with open(__file__, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if marker in line and "line_of(" not in line:
                return n
    raise LookupError(marker)
