"""A small, real training loop with one step traced by gradtrace.

Trains a tiny GPT-2 (``transformers``) on random token data, or a small pure-PyTorch language
model where ``transformers`` is not installed, and wraps step ``--trace-step`` in
``tracer.trace(out=...)``: forward, backward and the optimizer step of that one step are
recorded and streamed to ``--out``. Look at the result with::

    python examples/train.py --steps 5 --trace-step 2 --out step.gtrace
    gradtrace summary step.gtrace
    gradtrace report step.gtrace          # -> step.html
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer

VOCAB = 256
CONTEXT = 64


class TinyLM(nn.Module):
    """A pure-PyTorch fallback: embeddings, one pre-norm transformer block, tied output head."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, heads: int = 2, context: int = CONTEXT) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(seq, device=ids.device))
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=ids.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        # Tied output head, scaled so the initial logits are O(1) and the loss starts near log(vocab).
        return (self.ln_f(x) @ self.tok.weight.T) * self.tok.weight.shape[1] ** -0.5


def build_model(kind: str) -> tuple[nn.Module, str]:
    """The model and the name of what was built (``gpt2`` falls back to ``torch`` if needed)."""
    if kind in ("auto", "gpt2"):
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError:
            if kind == "gpt2":
                raise SystemExit("--model gpt2 needs the transformers package") from None
        else:
            # bos/eos inside the small vocabulary: the defaults (50256) only make transformers warn.
            config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=CONTEXT,
                                bos_token_id=0, eos_token_id=0)
            model = GPT2LMHeadModel(config)
            model.loss_type = "ForCausalLM"  # what it defaults to anyway, said aloud to skip a warning
            return model, "gpt2"
    return TinyLM(), "torch"


def lm_loss(model: nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a batch of token ids."""
    if kind == "gpt2":
        return model(input_ids=ids, labels=ids).loss
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--trace-step", type=int, default=None, metavar="N",
                   help="trace step N (counting from 0) into --out; default: trace nothing")
    p.add_argument("--out", default="train_step.gtrace", help="trace file (default train_step.gtrace)")
    p.add_argument("--hash", choices=("md5", "none"), default="md5", help="tensor checksums (default md5)")
    p.add_argument("--model", choices=("auto", "gpt2", "torch"), default="auto",
                   help="tiny GPT-2 from transformers, or the pure-PyTorch model (default: gpt2 if installed)")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--seq", type=int, default=32, help=f"tokens per sequence, at most {CONTEXT} (default 32)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 2 <= args.seq <= CONTEXT:
        p.error(f"--seq must be between 2 and {CONTEXT}")
    if args.trace_step is not None and not 0 <= args.trace_step < args.steps:
        p.error(f"--trace-step must be between 0 and {args.steps - 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model, kind = build_model(args.model)
    model.to(args.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Random tokens, drawn once: a fixed little data set the model can start to memorise.
    data = torch.randint(0, VOCAB, (8 * args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed))
    print(f"model {kind}, {sum(p.numel() for p in model.parameters())} parameters, device {args.device}")

    for step in range(args.steps):
        batch = data[(step * args.batch) % len(data):][: args.batch].to(args.device)
        traced = step == args.trace_step
        ctx = tracer.trace(out=args.out, hash=args.hash) if traced else contextlib.nullcontext()
        with ctx as t:
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model, kind, batch)
            loss.backward()
            opt.step()
        line = f"step {step} loss {loss.item():.4f}"
        if traced:
            line += (f"  [traced: {len(t.calls)} calls, {len(t.grad_nodes)} grad nodes, "
                     f"{len(t.tensors)} tensors -> {args.out}]")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
