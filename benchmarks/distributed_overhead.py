"""What tracing costs on each rank of a sharded step: the performance suite's Llama workload
under FSDP2 or tensor parallel x FSDP2, plain and traced, timed on every rank in one run.

    python -m torch.distributed.run --nproc_per_node=4 benchmarks/distributed_overhead.py \
        [--mode fsdp|tp] [--model llama-tiny|llama] [--device cpu|cuda] [--repeats 5] [--out FILE.md]

``--mode fsdp``: FSDP2 over all ranks; ``--mode tp``: a (world/2, 2) mesh ("dp", "tp"), tensor
parallel inside each pair and FSDP2 across pairs (the layout of tests/dist4_script.py, whose
sharding functions this script uses). The model is ``benchmarks/workloads.py``'s (``llama-tiny``
by default: 12 layers at width 96, 4 x 64 tokens; ``llama``: width 768, 8 x 1024 tokens on CUDA).
CPU runs use gloo, CUDA runs NCCL with one GPU per rank.

Rows, per rank: the plain step; ``trace(hash="none", stacks=True)`` (names, links and stacks,
no checksums: the suite's ``stacks`` row); ``trace(hash="fast")`` (everything, with the fast
checksum). The configurations take turns within every round, and every step starts after a
barrier, so a slow rank's time does not leak into the next row. Each timed step includes the
trace's exit (waiting for its checksums). The table goes to stdout (rank 0) and to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.dirname(HERE))

from dist4_script import shard_fsdp, shard_tp_fsdp  # noqa: E402  (tests/: the same layouts as the tests)
from workloads import build  # noqa: E402  (a sibling script, not a package)

import tracer  # noqa: E402

CONFIGS: dict[str, tuple[str, Callable[[], contextlib.AbstractContextManager[Any]]]] = {
    "plain": ("plain step", contextlib.nullcontext),
    "stacks": ('names+links+stacks: trace(hash="none", stacks=True)',
               lambda: tracer.trace(hash="none", stacks=True)),
    "fast": ('trace(hash="fast")', lambda: tracer.trace(hash="fast")),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("fsdp", "tp"), default="fsdp")
    ap.add_argument("--model", choices=("llama-tiny", "llama"), default="llama-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the table (markdown) here (rank 0)")
    args = ap.parse_args()

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(1)  # ranks share the cores
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    w = build(args.model, device, args.batch, args.seq)  # seeded: the same weights on every rank
    if args.mode == "fsdp":
        shard_fsdp(w.model, init_device_mesh(device.type, (world,), mesh_dim_names=("dp",)))
        dp_rank = rank
    else:
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        shard_tp_fsdp(w.model, mesh)
        dp_rank = mesh["dp"].get_local_rank()
    opt = torch.optim.AdamW(w.model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(100 + dp_rank)  # each data-parallel rank its own batch
    vocab = w.model.config.vocab_size
    ids = torch.randint(0, vocab, tuple(w.ids.shape), generator=gen).to(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        w.model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    counts: dict[str, tuple[int, int, int]] = {}
    for rnd in range(args.warmup + args.repeats):
        for key, (_, make) in CONFIGS.items():
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            with make() as t:
                step()
            sync()
            ms = (time.perf_counter() - t0) * 1000.0
            if rnd >= args.warmup:
                times[key].append(ms)
            if isinstance(t, tracer.Trace):
                counts[key] = (len(t.calls), len(t.tensors), sum(c.kind == "collective" for c in t.calls))
        if rank == 0:
            print(f"round {rnd + 1}/{args.warmup + args.repeats} done", file=sys.stderr, flush=True)
    mine = {"rank": rank, "median": {k: statistics.median(v) for k, v in times.items()},
            "spread": {k: (min(v), max(v)) for k, v in times.items()}, "counts": counts}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        text = report(args, world, w.describe(), gathered)
        print(text)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as fh:
                fh.write(text)
    dist.destroy_process_group()


def report(args: argparse.Namespace, world: int, describe: str, per_rank: list[dict[str, Any]]) -> str:
    layout = "FSDP2 over all ranks" if args.mode == "fsdp" else \
        f"tensor parallel 2 x FSDP2 {world // 2} on a ({world // 2}, 2) mesh (dp, tp)"
    calls, tensors, colls = per_rank[0]["counts"]["fast"]
    lines = [
        f"## {args.model}, {layout}, {world} ranks, {args.device} ({'nccl' if args.device == 'cuda' else 'gloo'})",
        "",
        f"{describe} per rank; torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPU cores seen; {args.repeats} timed rounds after {args.warmup} warm-up, "
        "medians (min-max). Rank 0's trace of one step: "
        f"{calls} calls, {tensors} tensor records, {colls} collective calls.",
        "",
        "| rank | plain step ms | names+links+stacks ms | ratio | hash=\"fast\" ms | ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(per_rank, key=lambda x: x["rank"]):
        m, s = r["median"], r["spread"]

        def cell(k: str, m: dict[str, float] = m, s: dict[str, tuple[float, float]] = s) -> str:
            return f"{m[k]:.1f} ({s[k][0]:.1f}-{s[k][1]:.1f})"

        lines.append(f"| {r['rank']} | {cell('plain')} | {cell('stacks')} | {m['stacks'] / m['plain']:.2f}x | "
                     f"{cell('fast')} | {m['fast'] / m['plain']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
