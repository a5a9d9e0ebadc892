"""One traced training step of a tiny Llama-style model (``transformers.LlamaConfig``) on four ranks,
run by tests/test_distributed_dtensor.py and benchmarks/distributed_overhead.py.

    python -m torch.distributed.run --nproc_per_node=4 tests/dist4_script.py --out DIR/step.gtrace \
        [--mode fsdp|tp] [--perturb PARAM] [--device cpu|cuda] [--untraced]
    python -m torch.distributed.run --nproc_per_node=4 tests/dist4_script.py \
        --job A/step.gtrace,fsdp --job B/step.gtrace,tp --job C/step.gtrace,tp,PARAM   # three steps, one launch

- ``--mode fsdp``: FSDP2 (``fully_shard``) over all ranks, one unit per decoder layer and the root.
- ``--mode tp``: a 2-D mesh ``("dp", "tp")`` of shape (2, 2): tensor parallelism inside each pair
  of ranks (``parallelize_module``: q/k/v and gate/up projections column-wise, o and down
  projections row-wise, the LM head column-wise gathered to a replicated output), the norm
  weights made ``Replicate()`` DTensors on the tp dimension (the residual stream stays a
  replicated DTensor between the row-wise outputs and the norms), and FSDP2 over the dp dimension
  on top of that, so every parameter is a 2-D DTensor.

``--perturb PARAM`` (a parameter path under the model): before the step, the last rank adds one
ulp to the first element of its local shard of that parameter (``torch.nextafter``), the silent
one-rank desync ``gradtrace diff --ranks`` must find. Every rank prints one ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.dist_exit import run_and_exit

VOCAB, SEQ, BATCH = 64, 16, 2


def build_model(layers: int = 2) -> torch.nn.Module:
    """The llama-tiny shape of benchmarks/workloads.py (3:1 GQA, SwiGLU, RMSNorm, rotary) at a
    smaller width, depth and vocabulary: four processes share two CPU cores in the tests."""
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy: only the script needs it

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"  # the default, named to avoid transformers' warning
    return model


def shard_fsdp(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def replicate_norms(model: torch.nn.Module, tp: DeviceMesh) -> None:
    """RMSNorm weights as ``Replicate()`` DTensors on the tp mesh: every rank of a tp group holds
    the whole weight, which must be the same there (what diff --ranks checks)."""
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.weight = torch.nn.Parameter(distribute_tensor(module.weight.data, tp, [Replicate()]))


def shard_tp_fsdp(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    tp, dp = mesh["tp"], mesh["dp"]
    # Row-wise outputs stay DTensors (Replicate) so the residual adds and the norms, whose weights
    # are replicated DTensors, see DTensors on both sides.
    keep = {"use_local_output": False}
    # The embedding column-wise (each rank of a tp group holds half of every token's vector),
    # all-gathered into a replicated DTensor. (Row-wise, DTensor cannot turn the gradient's
    # Partial(sum) back into the embedding's MaskPartial in backward.)
    parallelize_module(model.model, tp, {"embed_tokens": ColwiseParallel(output_layouts=Replicate(), **keep)})
    for layer in model.model.layers:
        parallelize_module(layer, tp, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(**keep),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(**keep),
        })
    parallelize_module(model, tp, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    replicate_norms(model, tp)
    shard_fsdp(model, dp)


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="trace file of the one step (one per rank)")
    ap.add_argument("--mode", choices=("fsdp", "tp"), default="fsdp")
    ap.add_argument("--perturb", default=None, help="parameter path (under the model) the last rank nudges")
    # (not --run: torchrun, which parses the script's arguments too, takes it for its --run-path)
    ap.add_argument("--job", action="append", default=[], metavar="OUT,MODE[,PERTURB]",
                    help="instead of --out/--mode/--perturb: one step per --job, in this one launch, each with "
                         "its own model, mesh and trace (four processes start once, not once per step)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--untraced", action="store_true")
    args = ap.parse_args()
    runs = [tuple(r.split(",")) for r in args.job] or [(args.out, args.mode, args.perturb)]
    if any(r[0] is None or len(r) not in (2, 3) or r[1] not in ("fsdp", "tp") for r in runs):
        ap.error("give --out, or --job OUT,MODE[,PERTURB] with MODE fsdp or tp")

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    for out, mode, *perturb in runs:
        step(out, mode, perturb[0] if perturb else None, args)
    dist.barrier()  # every rank done before any tears the group down (gloo aborts at exit otherwise)
    dist.destroy_process_group()


def step(out: str, mode: str, perturb: str | None, args: argparse.Namespace) -> None:
    """One traced training step of a fresh model sharded by ``mode``; prints this rank's RESULT."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = build_model(args.layers).to(args.device)
    if mode == "fsdp":
        mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("dp",))
        shard_fsdp(model, mesh)
        dp_rank = rank
    else:
        mesh = init_device_mesh(args.device, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        shard_tp_fsdp(model, mesh)
        dp_rank = mesh["dp"].get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Each data-parallel rank its own batch; the ranks of one tp group share theirs.
    gen = torch.Generator().manual_seed(100 + dp_rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(args.device)
    if perturb and rank == world - 1:
        with torch.no_grad():
            local = local_of(model.get_parameter(perturb)).view(-1)
            local[0] = torch.nextafter(local[0], local[0] + 1)

    # Checksums of two local shards taken by hand, for the test to hold the trace's against.
    local_md5 = {n: _md5(local_of(model.get_parameter(n))) for n in ("model.norm.weight", "lm_head.weight")}

    import tracer

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    ctx = tracer.trace(out=out) if not args.untraced else None
    t = ctx.__enter__() if ctx is not None else None
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    if ctx is not None:
        ctx.__exit__(None, None, None)
    params = {n: p for n, p in model.named_parameters()}
    norm = params["model.norm.weight"]
    result = {
        "rank": rank, "world": world, "out": out, "loss": float(local_of(loss.detach())),
        "path": None if t is None else t.meta.get("out"),
        "norm_placements": [str(p) for p in norm.placements] if isinstance(norm, DTensor) else None,
        "params": len(params), "dtensors": sum(isinstance(p, DTensor) for p in params.values()),
        "local_md5": local_md5,
    }
    print("RESULT " + json.dumps(result), flush=True)

if __name__ == "__main__":
    run_and_exit(main)
