"""A tiny GPT-2 training script (built from a config: nothing is downloaded), and the same script
with one change that acts first at step 23, for the step log and ``gradtrace bisect`` tests.

    python tests/steplog_gpt2.py --steps 30                    # the reference run
    python tests/steplog_gpt2.py --steps 30 --variant data     # forgets sampler.set_epoch: epoch 1 (step 23) reuses epoch 0's order
    python tests/steplog_gpt2.py --steps 30 --variant lr       # steps the scheduler before the optimizer: the decay at step 24 comes at 23
    python tests/steplog_gpt2.py --steps 30 --variant eps      # sets transformer.h.1.ln_1.eps to 1e-3 at step 23
    python tests/steplog_gpt2.py --steps 5 --unseeded          # the loader shuffles with an unseeded generator

92 samples in batches of 4 make 23 steps per epoch, so epoch 1 begins at step 23. Each step is a
few milliseconds on a CPU.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

SAMPLES, BATCH, SEQ, VOCAB = 92, 4, 16, 64
CHANGE_AT = 23
DECAY_AT = 24  # the learning rate halves from this step on


class EpochSampler(torch.utils.data.Sampler[int]):
    """Shuffles with a generator seeded from the epoch (``set_epoch``), as DistributedSampler does."""

    def __init__(self, n: int, generator: torch.Generator | None = None) -> None:
        self.n = n
        self.epoch = 0
        self.generator = generator

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]
        g = self.generator or torch.Generator().manual_seed(1000 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def build(variant: str, unseeded: bool) -> tuple[GPT2LMHeadModel, torch.optim.Optimizer, torch.utils.data.DataLoader,
                                                  EpochSampler, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # named, so transformers does not warn
    data = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(7))
    generator = None
    if unseeded:
        generator = torch.Generator()
        generator.seed()  # a different order in every run
    sampler = EpochSampler(SAMPLES, generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=BATCH, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < DECAY_AT else 0.5)
    return model, opt, loader, sampler, schedule


def train(steps: int, variant: str = "none", unseeded: bool = False) -> list[float]:
    """``steps`` optimizer steps; the losses."""
    model, opt, loader, sampler, schedule = build(variant, unseeded)
    model.train()
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        if variant != "data":  # the data variant forgets this: every epoch repeats epoch 0's order
            sampler.set_epoch(epoch)
        for (ids,) in loader:
            step = len(losses)
            if step == steps:
                break
            if variant == "eps" and step == CHANGE_AT:
                model.transformer.h[1].ln_1.eps = 1e-3
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if variant == "lr":
                schedule.step()  # before the optimizer: every learning rate comes one step early
                opt.step()
            else:
                opt.step()
                schedule.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        epoch += 1
    return losses


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--variant", choices=("none", "data", "lr", "eps"), default="none")
    p.add_argument("--unseeded", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    losses = train(args.steps, args.variant, args.unseeded)
    print(f"{len(losses)} steps, last loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
