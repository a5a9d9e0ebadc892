"""Throughput of the batched stats/fingerprint kernel (tracer.record.checksums.fused) on its own, on CUDA.

562 bf16 tensors shaped like a GPT-2 small step's (8 x 1024 tokens: hidden states, MLP
activations, two logits-sized tensors, biases and weights; 3.3 GB), queued and launched as the
trace does, best of three rounds per mode. The H200 moves about 4.8 TB/s; a step of GPT-2 small
makes ~52 GB of tensors, so GB/s here sets the GPU time ``hash="fast"`` adds to that step.

    python benchmarks/fused_kernel.py
"""

from __future__ import annotations

import sys
import time

import torch

from tracer.model import TensorRecord
from tracer.record.checksums.fused import Fused, triton_usable


def main() -> int:
    if not torch.cuda.is_available() or not triton_usable():
        print("needs a CUDA device and Triton", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    sizes = [8192 * 768] * 40 + [8192 * 3072] * 20 + [8192 * 50257] * 2 + [768] * 400 + [768 * 768] * 100
    ts = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in sizes]
    gb = sum(t.numel() * t.element_size() for t in ts) / 1e9
    rec = TensorRecord("x", (), "bfloat16", "cuda:0", "output", None)
    for stats, fp in ((True, True), (True, False), (False, True)):
        best_total = best_host = float("inf")
        for _ in range(3):
            batcher = Fused(stats=stats, fingerprint=fp)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for t in ts:
                batcher.add(rec, t)
            batcher.flush()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            best_host, best_total = min(best_host, t1 - t0), min(best_total, time.perf_counter() - t0)
            batcher.take(wait=True)
        print(f"stats={stats} fingerprint={fp}: {gb:.1f} GB in {len(ts)} tensors, {batcher.launches} launches, "
              f"host {best_host * 1e3:.1f} ms, GPU done after {best_total * 1e3:.1f} ms = {gb / best_total:.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
