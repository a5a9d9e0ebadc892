"""Eight planted bugs of a training step, each with the story every surface must tell: the call
that made the NaN/Inf (or first read it, when it arrived from outside the step), its phase and the
user's line (the line of this file carrying ``STORY``). tests/test_stories.py runs each through
``t.anomalies``, ``raise_on_nonfinite``, the warning, ``gradtrace summary``/``show``/``memory``,
the HTML report in a browser, the notebook card and the watch under ``raise`` and ``skip``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, PAD = 32, 0


def line_of(marker: str) -> int:
    """The line of this file that carries ``marker``."""
    with open(__file__, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if marker in line and "line_of(" not in line and "marker=" not in line:
                return n
    raise LookupError(marker)


@dataclass
class State:
    """What one story's step works on (the watch snapshots ``model`` and ``opt``)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    batch: Any
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Story:
    name: str
    make: Callable[[], State]
    step: Callable[[State], torch.Tensor]
    producer: str  # the call or grad node named (the origin, or the first reader of an arrival)
    phase: str
    marker: str  # the user's line
    kind: str = "nan"
    arrived: bool = False  # the value came from outside the step (the story says "arrived")
    skipped: bool = False  # GradScaler skipped the step: not a bug, and the story says so
    node: str | None = None  # backward: the grad node whose own code made it
    micro_batch: tuple[int, int] | None = None

    @property
    def line(self) -> int:
        return line_of(self.marker)


# ---- models ---------------------------------------------------------------------------------------
def _mlp(seed: int = 0, lr: float = 1e-3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


class MaskedAttention(torch.autograd.Function):
    """Attention with an intended -inf mask in forward (a fully masked row attends to nothing) and
    a hand-written backward that renormalises by the row sum: 0/0 on a fully masked row."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # intended: the mask
        p = torch.where(mask.any(-1, keepdim=True), p, 0.0)  # a fully masked row attends to nothing
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, p = ctx.saved_tensors
        dp = g @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / p.sum(-1, keepdim=True)  # STORY: 0/0 masked row
        ds = ds / math.sqrt(q.shape[-1])
        return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ g, None


class AttentionLM(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, VOCAB)
        self.register_buffer("never", torch.arange(VOCAB) == PAD, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        mask = (ids != PAD)[:, None, :] & (ids != PAD)[:, :, None]  # a padding query sees nothing
        logits = self.out(h + MaskedAttention.apply(q, k, v, mask))
        return logits.masked_fill(self.never, float("-inf"))  # intended: PAD is never predicted


def _attention_state() -> State:
    torch.manual_seed(0)
    model = AttentionLM()
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    ids[0, 0] = PAD  # left padding: the first query's row is fully masked
    return State(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ids)


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), ignore_index=PAD)


class WithSlowWeights(nn.Module):
    """An MLP with a slow (EMA) copy of its weights kept as buffers and folded back into them after
    each optimizer step (Lookahead-style): the snapshot of a watch holds both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        for i, p in enumerate(self.net.parameters()):
            self.register_buffer(f"slow{i}", p.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def slow(self) -> list[torch.Tensor]:
        return [getattr(self, f"slow{i}") for i in range(len(list(self.net.parameters())))]


# ---- the eight steps --------------------------------------------------------------------------------
def step_log_negative(s: State) -> torch.Tensor:
    h = s.model(s.batch)
    loss = torch.log(h.mean(-1) - 10).mean()  # STORY: log of a negative
    loss.backward()
    s.opt.step()
    s.opt.zero_grad()
    return loss


def step_masked_backward(s: State) -> torch.Tensor:
    loss = _lm_loss(s.model, s.batch)
    loss.backward()
    s.opt.step()
    s.opt.zero_grad()
    return loss


def step_clip_after_nan(s: State) -> torch.Tensor:
    loss = _lm_loss(s.model, s.batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(s.model.parameters(), 1.0)
    s.opt.step()
    s.opt.zero_grad()
    return loss


def step_adamw_lr_nan(s: State) -> torch.Tensor:
    loss = s.model(s.batch).pow(2).mean()
    loss.backward()
    s.opt.step()  # STORY: AdamW with lr=nan
    s.opt.zero_grad()
    return loss


def step_grad_scaler(s: State) -> torch.Tensor:
    scaler: torch.amp.GradScaler = s.extra["scaler"]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = s.model(s.batch).pow(2).mean()
    scaler.scale(loss).backward()  # STORY: the loss scale overflows fp16
    scaler.step(s.opt)
    scaler.update()
    s.opt.zero_grad()
    return loss


def step_slow_weights(s: State) -> torch.Tensor:
    loss = s.model(s.batch).pow(2).mean()
    loss.backward()
    s.opt.step()
    s.opt.zero_grad()
    decay = s.extra["decay"]
    with torch.no_grad():
        for slow, p in zip(s.model.slow(), s.model.net.parameters()):  # type: ignore[operator]
            slow.data.mul_(decay).add_(p.data, alpha=1 - decay)  # STORY: EMA with a NaN decay
            p.data.copy_(slow.data)
    return loss


def step_nan_batch(s: State) -> torch.Tensor:
    h = s.model(s.batch)  # STORY: the batch holds a NaN
    loss = h.pow(2).mean()
    loss.backward()
    s.opt.step()
    s.opt.zero_grad()
    return loss


def step_accumulation(s: State) -> torch.Tensor:
    total = torch.zeros(())
    for k, x in enumerate(s.batch):
        h = s.model(x)
        shift = 1.0 if k == 0 else -100.0
        loss = torch.log(h.pow(2).mean() + shift) / len(s.batch)  # STORY: micro-batch 2
        loss.backward()
        total = total + loss.detach()
    s.opt.step()
    s.opt.zero_grad()
    return total


def _mlp_state(batch: torch.Tensor, lr: float = 1e-3) -> State:
    model, opt = _mlp(lr=lr)
    return State(model, opt, batch)


def _lr_nan_state() -> State:
    s = _mlp_state(torch.randn(4, 8, generator=torch.Generator().manual_seed(3)))
    s.opt.param_groups[0]["lr"] = float("nan")  # a schedule gone wrong (AdamW refuses it at construction)
    return s


def _scaler_state() -> State:
    s = _mlp_state(torch.randn(4, 8, generator=torch.Generator().manual_seed(3)) * 30)
    s.extra["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    return s


def _slow_state() -> State:
    model = WithSlowWeights()
    return State(model, torch.optim.AdamW(model.net.parameters(), lr=1e-3),
                 torch.randn(4, 8, generator=torch.Generator().manual_seed(3)), {"decay": float("nan")})


def _nan_batch_state() -> State:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    x[1, 2] = float("nan")  # a corrupt sample from the data pipeline
    return _mlp_state(x)


def _accumulation_state() -> State:
    g = torch.Generator().manual_seed(3)
    return _mlp_state([torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)])  # type: ignore[arg-type]


STORIES = [
    Story("log_negative", lambda: _mlp_state(torch.randn(4, 8, generator=torch.Generator().manual_seed(3))),
          step_log_negative, "log0", "forward", "STORY: log of a negative"),
    Story("masked_backward", _attention_state, step_masked_backward, "div1", "backward", "STORY: 0/0 masked row",
          node="MaskedAttention0/MaskedAttentionBackward"),
    Story("clip_after_nan", _attention_state, step_clip_after_nan, "div1", "backward", "STORY: 0/0 masked row",
          node="MaskedAttention0/MaskedAttentionBackward"),
    Story("adamw_lr_nan", _lr_nan_state, step_adamw_lr_nan, "AdamW0", "optimizer", "STORY: AdamW with lr=nan"),
    Story("grad_scaler_overflow", _scaler_state, step_grad_scaler, "mul0/MulBackward0", "backward",
          "STORY: the loss scale overflows fp16", kind="inf", skipped=True),
    Story("slow_weights_nan", _slow_state, step_slow_weights, "mul_0", "optimizer", "STORY: EMA with a NaN decay"),
    Story("nan_batch", _nan_batch_state, step_nan_batch, "linear0", "forward", "STORY: the batch holds a NaN",
          arrived=True),
    Story("accumulation_micro_batch_2", _accumulation_state, step_accumulation, "log1", "forward",
          "STORY: micro-batch 2", micro_batch=(2, 2)),
]
