"""What ``tracer.trace(steps=...)`` costs on the steps it does not trace.

Between chosen steps only one global optimizer step post-hook is installed (no mode, no module
hooks, no ``Function.apply`` wrapper), so an untraced step should run at plain speed. This runs
the same training steps plain and inside ``tracer.trace(steps=...)`` whose chosen step is never
reached, alternating the two within every repeat so machine drift falls on both alike, and
prints the ratio of the median step times.

    python benchmarks/untraced_steps.py                    # tiny GPT-2 (transformers) on the CPU
    python benchmarks/untraced_steps.py --model mlp        # a small MLP: per-step overhead most visible
    python benchmarks/untraced_steps.py --device cuda --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import tracer


def build(model: str, device: torch.device) -> Callable[[], None]:
    """One training step (forward, backward, AdamW step, zero_grad) of the chosen model."""
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                            bos_token_id=0, eos_token_id=0)
        net: torch.nn.Module = GPT2LMHeadModel(config).to(device).train()
        ids = torch.randint(0, 256, (4, 64), device=device)

        def loss() -> torch.Tensor:
            return net(input_ids=ids, labels=ids).loss
    else:
        net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(device)
        x = torch.randn(32, 64, device=device)

        def loss() -> torch.Tensor:
            return net(x).pow(2).mean()

    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step() -> None:
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed_loop(step: Callable[[], None], n: int, device: torch.device) -> float:
    """Seconds per step over ``n`` steps."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt2", "mlp"), default="gpt2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=50, help="steps per timed loop (default 50)")
    p.add_argument("--repeats", type=int, default=7, help="alternating plain/untraced loops (default 7)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    step = build(args.model, device)
    timed_loop(step, 5, device)  # warm-up: allocator, kernels, lazy optimizer state

    plain, untraced = [], []
    for _ in range(args.repeats):
        plain.append(timed_loop(step, args.steps, device))
        # The chosen step lies beyond the loop: every step here is an untraced one.
        with tracer.trace(steps=str(10**9)) as st:
            untraced.append(timed_loop(step, args.steps, device))
        assert st.steps == [] and st.step == args.steps
    p_med, u_med = statistics.median(plain), statistics.median(untraced)
    print(f"model {args.model} on {device}, {args.steps} steps x {args.repeats} repeats (medians)")
    print(f"plain step           {p_med * 1e3:9.3f} ms")
    print(f"untraced step        {u_med * 1e3:9.3f} ms   (inside tracer.trace(steps=...), step not chosen)")
    print(f"ratio                {u_med / p_med:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
