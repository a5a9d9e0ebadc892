"""Models with a data-dependent NaN for the watch tests: a tiny GPT-2 whose loss is normalised by
a token count that one batch makes zero, and a tiny language model whose attention is a custom
``autograd.Function`` that breaks on a fully masked row (left padding), in its forward or in its
hand-written backward."""

from __future__ import annotations

import hashlib
import math
import textwrap
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD = 0
VOCAB = 32


def line_of(marker: str) -> int:
    """The line of this file that carries ``marker`` (the exact line a report must name)."""
    with open(__file__, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if marker in line and "line_of(" not in line:
                return n
    raise LookupError(marker)


def tiny_gpt2() -> nn.Module:
    import transformers as tf

    config = tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
                           eos_token_id=0)
    model = tf.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def masked_lm_loss(model: nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the kept tokens; an all-dropped batch divides 0 by 0."""
    logits = model(input_ids=ids).logits[:, :-1]
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
    weights = keep[:, 1:].reshape(-1)
    return (per_token * weights).sum() / weights.sum()  # BUG: no guard for an empty batch


def gpt2_train_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The watched step of the GPT-2 tests: masked LM loss, backward, optimizer step, zero_grad."""
    def train_step(ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        loss = masked_lm_loss(model, ids, keep)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


def gpt2_batches(steps: int, bad_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        ids = torch.randint(1, VOCAB, (2, 8), generator=g)
        keep = torch.ones(2, 8)
        if step == bad_step:
            keep.zero_()  # every token filtered out
        yield ids, keep


class AttentionNaNForward(torch.autograd.Function):
    """Masked attention; a fully masked row gives softmax over all -inf: NaN in forward."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # BUG-FORWARD
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved_tensors
        dp = g @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
        return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ g, None


class AttentionNaNBackward(torch.autograd.Function):
    """Masked attention with a finite forward (a fully masked row attends to nothing) and a
    hand-written backward that renormalises by the row sum: 0/0 on a fully masked row."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        p = torch.softmax(scores.masked_fill(~mask, -1e4), dim=-1) * mask
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved_tensors
        dp = g @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / p.sum(-1, keepdim=True)  # BUG-BACKWARD
        ds = ds / math.sqrt(q.shape[-1])
        return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ g, None


class TinyAttentionLM(nn.Module):
    def __init__(self, attention: type[torch.autograd.Function], dim: int = 16) -> None:
        super().__init__()
        self.attention = attention
        self.emb = nn.Embedding(VOCAB, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        t = ids.shape[1]
        mask = (ids != PAD)[:, None, :] & torch.ones(t, t, dtype=torch.bool).tril()
        return self.out(h + self.attention.apply(q, k, v, mask))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), ignore_index=PAD)


def padded_batches(steps: int, bad_step: int) -> Iterator[torch.Tensor]:
    """Token ids; at ``bad_step`` the first sequence is left-padded by one token."""
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        ids = torch.randint(1, VOCAB, (2, 8), generator=g)
        if step == bad_step:
            ids[0, 0] = PAD
        yield ids


def checksum(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """MD5 over every parameter's bytes and the optimizer's state (tensors and values)."""
    h = hashlib.md5()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for i, p in enumerate(model.parameters()):
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            h.update(f"{i}.{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(value).encode())
    for group in optimizer.param_groups:
        h.update(repr(sorted((k, v) for k, v in group.items() if k != "params")).encode())
    return h.hexdigest()


# A program for `gradtrace run --watch`: log(0) makes the loss -Inf at step 3.
WATCHED = textwrap.dedent("""\
    import torch, tracer
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tracer.watch(model, opt, out="incident.gtrace")
    def train_step(x):
        loss = model(x).pow(2).mean() + x.abs().mean().log()  # log(0) at step 3
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for step in range(6):
        train_step(torch.zeros(2, 4) if step == 3 else torch.ones(2, 4) + step)
    """)
