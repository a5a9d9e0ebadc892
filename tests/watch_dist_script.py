"""A watched loop on two gloo ranks, run by tests/test_watch_run.py under torchrun.

Each rank trains its own small model on its own data; rank 1's batch at step 3 holds a NaN. The
trip flag is all-reduced (lazily: ``lag=1``), so both ranks replay step 3 and write their own
incident file. Each rank prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tracer
from tests.dist_exit import run_and_exit


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tracer.watch(model, opt, out=out, policy="skip", lag=1)
    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for step in range(8):
        x = torch.randn(4, 4)
        if rank == 1 and step == 3:
            x[0, 0] = float("nan")
        train_step(x)
    train_step.watch.close()
    incidents = [{"step": i.step, "path": i.path, "reason": i.reason, "reproduced": i.reproduced,
                  "undone": i.undone, "rank": i.rank} for i in train_step.watch.incidents]
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print("RESULT " + json.dumps({"rank": rank, "incidents": incidents, "finite": finite,
                                  "steps": train_step.watch.step}), flush=True)
    dist.barrier()  # every rank done before any tears the group down (gloo aborts at exit otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)
