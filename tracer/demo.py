"""The bundled demo: a tiny GPT-style language model and one training step, in plain PyTorch.

``gradtrace demo`` traces ``demo_step`` on CPU. Everything the trace points at is written out
here as ordinary readable code, so the call stacks in the report lead to lines in this file (the
stack filter treats ``tracer/demo.py`` as user code although it ships inside the package).

The model: token + position embeddings, two pre-norm transformer blocks (causal self-attention
through ``F.scaled_dot_product_attention`` and an MLP), a final LayerNorm and an lm head tied to
the token embedding, trained with cross-entropy and AdamW. The MLP clamps its hidden activations
with a custom ``torch.autograd.Function`` whose backward passes the gradient straight through, so
a trace shows a custom Function, the ops nested in its forward and its grad node.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 128
D_MODEL = 64
N_HEAD = 4
N_LAYER = 2
SEQ_LEN = 32
BATCH = 4


class StraightThroughClamp(torch.autograd.Function):
    """Clamp in the forward pass; pass the gradient through unchanged in the backward pass."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, limit: float) -> torch.Tensor:
        return x.clamp(-limit, limit)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q = q.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, d_model: int, clamp: float = 4.0) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.clamp = clamp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x))
        h = StraightThroughClamp.apply(h, self.clamp)
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, d_model: int = D_MODEL, n_head: int = N_HEAD,
                 n_layer: int = N_LAYER, seq_len: int = SEQ_LEN) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.h = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        # GPT-2 style init: small normal weights, residual projections scaled by depth.
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight)  # lm head tied to the token embedding
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_demo(seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    """The demo model, its AdamW optimizer and one batch ``(tokens, targets)``, all seeded.

    The global RNG is forked, so building the demo does not disturb the caller's random state.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyGPT()
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return model, optimizer, batch


def demo_step(model: TinyGPT, optimizer: torch.optim.Optimizer,
              batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One training step: forward, backward, AdamW update. Returns the loss."""
    idx, targets = batch
    optimizer.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    optimizer.step()
    return loss.detach()
