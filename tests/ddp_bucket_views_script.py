"""DDP with several buckets, with and without ``gradient_as_bucket_view``, and with a comm hook
(``fp16_compress_hook``, whose future decompresses into the bucket where the trace cannot see it):
one traced step through
the per-tensor reads and the same step through the batches, run by tests/test_distributed.py.

    python -m torch.distributed.run --nproc_per_node=2 tests/ddp_bucket_views_script.py [--device cuda] [--backend gloo]

With bucket views each ``.grad`` is a view into a bucket that the all-reduce (NCCL: on its own
stream, while the backward goes on) averages in place, and no recorded op writes it. The batches
hold gradients until they launch, so a gradient recorded at its accumulation must still be
read as it was then, not as the all-reduce left it. For each setting, each rank writes
a JSON file (its path on a ``RESULT {json}`` line): per path, every record's fingerprint and stats
by name, DDP's record's inputs and outputs, and the averaged gradients read again afterwards; the
MD5 of every parameter and gradient after the step, with the same for the step untraced.

Paths: on CUDA the per-tensor torch reads (``GRADTRACE_TRITON=0``) against the batched Triton
kernels; on the CPU the host reads against the batches under Triton's interpreter
(``GRADTRACE_FUSED_INTERPRET=1``, with ``TRITON_INTERPRET=1`` set before Triton is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.dist_exit import run_and_exit
from tests.dist_script import TinyLM


def _state_md5(model: torch.nn.Module) -> dict[str, str]:
    out = {}
    for name, p in model.named_parameters():
        for label, t in ((name, p), (f"{name}.grad", p.grad)):
            if t is not None:
                data = t.detach().float().cpu().contiguous().numpy().tobytes()
                out[label] = hashlib.md5(data).hexdigest()
    return out


def _step(device: torch.device, rank: int, bucket_view: bool, comm_hook: bool, traced: bool) -> dict[str, object]:
    import tracer

    torch.manual_seed(0)
    model = TinyLM(d=32, layers=2).to(device)
    # Small buckets: several all-reduces, each started while the backward still runs.
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.01)
    if comm_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, 32, (4, 12), generator=g).to(device) for _ in range(2)]

    def backward(idx: torch.Tensor) -> None:
        logits = ddp(idx[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()

    backward(batches[0])
    opt.step()
    opt.zero_grad(set_to_none=False)  # the traced step accumulates into the zeroed bucket views
    with tracer.trace(hash="fast", stats=True) if traced else contextlib.nullcontext() as t:
        backward(batches[1])
        grads = _state_md5(model)  # the averaged gradients, before the optimizer
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    out: dict[str, object] = {"records": {}, "grads": grads, "after": _state_md5(model)}
    if not traced:
        return out
    out["records"] = {name: [r.fingerprint, None if r.stats is None else [r.stats.min, r.stats.max, r.stats.nan],
                             r.hash_note] for name, r in t.tensors.items()}
    ddp_calls = [c for c in t.calls if c.api.endswith("reducer.allreduce")]
    assert len(ddp_calls) == 1, [c.name for c in ddp_calls]
    out["averaged"], out["local"] = ddp_calls[0].outputs, ddp_calls[0].inputs
    # The averaged gradients as they are now, read by the host/torch path in a trace of their own.
    saved = {k: os.environ.pop(k) for k in ("GRADTRACE_FUSED_INTERPRET", "GRADTRACE_TRITON") if k in os.environ}
    try:
        with tracer.trace(hash="fast") as now:
            for p in model.parameters():
                if p.grad is not None:  # (an unused parameter's, under find_unused_parameters)
                    p.grad.clone()
    finally:
        os.environ.update(saved)
    out["truth"] = [r.fingerprint for name, r in now.tensors.items() if name.startswith("clone")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default=None, help="default: nccl on CUDA, gloo on the CPU (gloo on CUDA: both "
                    "ranks may share one GPU; its all-reduce copies through the host on streams of its own)")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if not cuda and "triton" not in sys.modules:  # Triton reads it when the kernels are decorated
        os.environ["TRITON_INTERPRET"] = "1"
    rank = int(os.environ["RANK"])
    backend = a.backend or ("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group(backend)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    switch, values = ("GRADTRACE_TRITON", ("0", "1")) if cuda else ("GRADTRACE_FUSED_INTERPRET", ("0", "1"))
    for bucket_view, comm_hook in ((False, False), (True, False), (True, True)):
        result: dict[str, object] = {"rank": rank, "bucket_view": bucket_view, "comm_hook": comm_hook,
                                     "untraced": _step(device, rank, bucket_view, comm_hook, traced=False)}
        for label, value in zip(("per_tensor", "batched"), values):
            os.environ[switch] = value  # read by each trace's hasher
            try:
                result[label] = _step(device, rank, bucket_view, comm_hook, traced=True)
            finally:
                os.environ.pop(switch, None)
        # (Each result is ~200 kB: written to a file of its own, since two ranks' large writes
        # into one pipe interleave; the line printed is short.)
        setting = ("views" if bucket_view else "copies") + ("+hook" if comm_hook else "")
        path = os.path.abspath(f"bucket_views.rank{rank}.{setting}.json")
        with open(path, "w") as f:
            json.dump(result, f)
        print("RESULT " + json.dumps({"rank": rank, "file": path}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)
