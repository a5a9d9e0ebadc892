"""One traced training step of a small transformer under DDP or FSDP2, run by tests/test_distributed.py.

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_script.py --out DIR/step.gtrace \
        [--mode ddp|fsdp] [--perturb PARAM] [--device cpu|cuda] [--untraced]

Each rank trains on its own data shard; with ``--perturb PARAM`` rank 1 adds 1e-6 to that
parameter's gradient after DDP's all-reduce, before the optimizer step (the classic silent
replica drift). ``--untraced`` runs the step without gradtrace (the run-under-torchrun test
traces it from outside). Each rank prints one ``RESULT {json}`` line for the test to check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.dist_exit import run_and_exit


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--perturb", default=None, help="parameter path (under the model) rank 1 nudges")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--untraced", action="store_true")
    args = ap.parse_args()

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them anyway)
    model = TinyLM().to(device)
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped: nn.Module = DDP(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The mesh named: fully_shard's default mesh is on CUDA whenever CUDA exists, even for a
        # gloo run on a machine with fewer GPUs than ranks.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard
    idx = torch.randint(0, 32, (2, 8), generator=gen).to(device)

    import tracer
    from tracer.record import recorder as _rec
    # all_gather_single is newer than some torch releases (2.11 lacks it): use what exists.
    names = [n for n in ("all_reduce", "broadcast", "barrier", "all_gather_single") if hasattr(dist, n)]
    before = {name: getattr(dist, name) for name in names}
    ctx = tracer.trace(out=args.out) if not args.untraced else None
    t = ctx.__enter__() if ctx is not None else None
    logits = wrapped(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)  # an explicit collective: the mean loss for logging
    avg = total / world
    flag = torch.tensor([float(rank == 0)], device=device)
    dist.broadcast(flag, src=0)
    gathered = torch.empty(world, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, loss.detach().reshape(1))
    dist.barrier()
    if args.perturb and rank == 1:
        param = model.get_parameter(args.perturb)
        with torch.no_grad():
            param.grad.add_(1e-6)  # rank 1 departs: its replica now steps differently
    opt.step()
    if ctx is not None:
        ctx.__exit__(None, None, None)
    after = {name: getattr(dist, name) for name in before}
    head_grad = model.head.weight.grad
    result = {
        "rank": rank, "world": world, "loss": float(avg),
        "restored": all(after[k] is before[k] for k in before) and _rec.active_recorder() is None,
        "path": None if t is None else t.meta.get("out"),
        # Checksums taken by hand, for the test to hold the trace's against.
        "total_md5": _md5(total),
        "head_grad_md5": None if head_grad is None or args.mode != "ddp" else _md5(head_grad),
    }
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()  # every rank done before any tears the group down (gloo aborts at exit otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)
