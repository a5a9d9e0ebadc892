"""``WatchCallback`` for a real Hugging Face ``Trainer`` and a real Lightning ``Trainer``, both with
gradient accumulation: a poisoned sample makes the loss NaN in one step; the step is replayed
from its micro-batches and, with ``policy="skip"``, the state after it is bit-equal to before."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import tracer
from tests.watch_models import checksum, line_of, tiny_gpt2

HERE = os.path.abspath(__file__)


pytestmark = pytest.mark.usefixtures("one_thread")


class Poisonable(torch.nn.Module):
    """A tiny GPT-2 whose loss goes NaN on a batch holding a poisoned sample."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny_gpt2()
        self.poisoned_at: list[int] = []

    def forward(self, input_ids, labels, poison):
        loss = self.gpt(input_ids=input_ids, labels=labels).loss
        return {"loss": loss * torch.sqrt(1 - 2 * poison.float().max())}  # POISON: sqrt(-1)


def test_hf_trainer_watch_callback_replays_the_poisoned_accumulation_step(tmp_path):
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tracer.integrations.hf import WatchCallback

    model = Poisonable()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 32, (16, 8), generator=g)
    data = [{"input_ids": row, "labels": row, "poison": torch.tensor(int(i == 5))} for i, row in enumerate(ids)]
    args = tf.TrainingArguments(output_dir=os.fspath(tmp_path / "hf"), max_steps=4, per_device_train_batch_size=2,
                                gradient_accumulation_steps=2, report_to=[], save_strategy="no",
                                logging_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
                                max_grad_norm=1.0)
    digests: dict[str, list[str]] = {"begin": [], "end": []}

    class Spy(tf.TrainerCallback):  # runs after the watch: sees the state it left
        def on_step_begin(self, args, state, control, **kw):
            digests["begin"].append(checksum(model, trainer.optimizer.optimizer))

        def on_step_end(self, args, state, control, **kw):
            digests["end"].append(checksum(model, trainer.optimizer.optimizer))

    class Step(tf.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.now = state.global_step

    step = Step()
    original_forward = model.forward

    @functools.wraps(original_forward)  # the Trainer keeps the columns forward's signature names
    def forward(**batch):
        if int(batch["poison"].max()):
            model.poisoned_at.append(step.now)
        return original_forward(**batch)

    model.forward = forward  # type: ignore[method-assign]
    cb = WatchCallback(out=tmp_path / "incident.gtrace", policy="skip")
    trainer = tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[step, cb, Spy()])
    trainer.train()

    [bad] = sorted(set(model.poisoned_at))
    [incident] = cb.watch.incidents
    assert incident.step == bad and incident.reproduced and incident.same_loss_bits
    assert digests["end"][bad] == digests["begin"][bad]
    assert digests["end"][bad - 1] != digests["begin"][bad - 1] if bad else True
    t = tracer.load(incident.path)
    assert len(t.backward_runs) == 2  # both micro-batches of the accumulation step
    a = t.anomalies.forward
    assert (a.producer_kind, a.origin, a.stack[-1].file, a.stack[-1].line) == \
        ("torch.sqrt", True, HERE, line_of_here("POISON"))
    assert cb.watch.closed and "training_step" not in trainer.__dict__  # given back after train()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def line_of_here(marker: str) -> int:
    with open(HERE, encoding="utf-8") as fh:
        return next(n for n, line in enumerate(fh, 1) if marker in line and "line_of_here(" not in line)


def test_lightning_watch_callback_with_gradient_accumulation(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from tracer.integrations.lightning import WatchCallback

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y, poison = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            return loss * torch.sqrt(1 - 2 * poison.max())  # POISON-PL

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    poison = torch.zeros(24)
    poison[9] = 1.0  # batch 4 (batch size 2): the second micro-batch of step 2
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1), poison)
    module = Regressor()
    digests: dict[int, list[str]] = {}

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            digests.setdefault(trainer.global_step, []).append(checksum(pl_module, trainer.optimizers[0]))

    cb = WatchCallback(out=tmp_path / "pl.gtrace", policy="skip")
    trainer = L.Trainer(max_steps=5, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                        callbacks=[cb, Spy()], default_root_dir=os.fspath(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))

    [incident] = cb.watch.incidents
    assert incident.step == 2 and incident.reproduced and incident.same_loss_bits
    # skip: step 2's update was undone, so the optimizer stepped 4 times in 5 steps ...
    assert trainer.optimizers[0].state[module.net[0].weight]["step"].item() == 4
    # ... and step 3 began from the state step 2 began from (the stale gradients aside)
    assert digests[3][0] == digests[2][0]
    t = tracer.load(incident.path)
    assert len(t.backward_runs) == 2
    a = t.anomalies.forward
    assert (a.producer_kind, a.stack[-1].line) == ("torch.sqrt", line_of_here("POISON-PL"))
    assert cb.watch.closed


def test_watch_callbacks_check_their_options_at_once():
    pytest.importorskip("transformers")
    from tracer.integrations.hf import WatchCallback

    with pytest.raises(tracer.TraceError, match="policy must be"):
        WatchCallback(policy="ignore")


def test_line_helper_finds_the_marked_lines():
    assert line_of("BUG-BACKWARD") > line_of("BUG-FORWARD") > line_of("BUG: no guard")
