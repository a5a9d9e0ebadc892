"""A small, real training loop with one step traced by gradtrace.

Trains a tiny GPT-2 (``transformers``) on random token data, or a small pure-PyTorch language
model where ``transformers`` is not installed, and wraps step ``--trace-step`` in
``tracer.trace(out=...)``: forward, backward and the optimizer step of that one step are
recorded and streamed to ``--out``. Look at the result with::

    python examples/train.py --steps 5 --trace-step 2 --out a.gtrace
    gradtrace summary a.gtrace
    gradtrace report a.gtrace             # -> a.html

With ``--ddp`` under ``torchrun`` the model is wrapped in ``DistributedDataParallel`` (gloo on the
CPU, nccl on GPUs), each rank trains on its own batches and writes its own trace::

    torchrun --nproc-per-node 2 examples/train.py --ddp --steps 5 --trace-step 2 --out ddp.gtrace
    gradtrace diff --ranks ddp.rank*.gtrace   # ddp.rank0.gtrace, ddp.rank1.gtrace
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
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
    p.add_argument("--ddp", action="store_true",
                   help="DistributedDataParallel over the processes torchrun starts; each rank writes "
                        "OUT.rankN.gtrace")
    args = p.parse_args(argv)
    if not 2 <= args.seq <= CONTEXT:
        p.error(f"--seq must be between 2 and {CONTEXT}")
    if args.trace_step is not None and not 0 <= args.trace_step < args.steps:
        p.error(f"--trace-step must be between 0 and {args.steps - 1}")
    return args


def start_ddp(device: str) -> tuple[int, str]:
    """Join the process group torchrun set up; this rank and the device it trains on."""
    cuda = device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    return rank, device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, device = start_ddp(args.device) if args.ddp else (0, args.device)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model, kind = build_model(args.model)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model)
    # Random tokens, drawn once: a fixed little data set the model can start to memorise.
    data = torch.randint(0, VOCAB, (8 * args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed))
    # Each rank its own batches: 0, world, 2 * world, ... for rank 0.
    world = dist.get_world_size() if args.ddp else 1
    say = print if rank == 0 else _quiet
    say(f"model {kind}, {sum(p.numel() for p in model.parameters())} parameters, device {device}"
        + (f", {world} ranks" if args.ddp else ""))

    for step in range(args.steps):
        index = step * world + rank
        batch = data[(index * args.batch) % len(data):][: args.batch].to(device)
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
                     f"{len(t.tensors)} tensors -> {t.meta.get('out', args.out)}]")
        say(line, flush=True)
    if args.ddp:
        # Every rank done before any tears its group down: gloo aborts a rank whose peer closes
        # the connections under its still-running threads (1 exit in 5 without the barrier).
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _quiet(*args: object, **kwargs: object) -> None:
    """Ranks other than 0 print nothing: one log for the run."""


if __name__ == "__main__":
    sys.exit(main())
