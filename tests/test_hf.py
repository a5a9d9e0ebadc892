"""Framework callbacks: chosen steps of a real Hugging Face ``Trainer`` / Lightning ``Trainer`` run."""

from __future__ import annotations

import os

import pytest
import torch

import tracer
from tracer.model import load_steps


def test_hf_trainer_callback_traces_the_chosen_steps_of_a_tiny_gpt2(tmp_path):
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer needs it
    from tracer.integrations.hf import TraceCallback

    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                             bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 100, (10, 8))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = tf.TrainingArguments(output_dir=os.fspath(tmp_path / "hf"), max_steps=5, per_device_train_batch_size=2,
                                report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                use_cpu=True, dataloader_num_workers=0)
    out = os.fspath(tmp_path / "hf.gtrace")
    seen: list[int] = []

    class Spy(tf.TrainerCallback):  # what is installed while the Trainer runs each step's forward
        def on_step_begin(self, args, state, control, **kw):
            from tracer.record.recorder import active_recorder

            seen.append(active_recorder() is not None)

    callback = TraceCallback(steps="1,3", out=out)
    trainer = tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback, Spy()])
    trainer.train()

    assert trainer.state.global_step == 5
    assert seen == [False, True, False, True, False]
    assert callback.steps == [1, 3] and callback.paths == [out]
    steps = load_steps(out)
    assert list(steps) == [1, 3]
    assert tracer.load(out).meta["steps_in_file"] == [1, 3]
    for n, t in steps.items():
        assert t.header["step"] == n and t.status == "ok"
        assert len(t.backward_runs) == 1
        assert t["transformer.wte.weight"].role == "param"
        assert "transformer.wte.weight.exp_avg" in t  # the optimizer step is inside the step's trace
        assert any(c.api == "torch.nn.functional.embedding" for c in t.calls)
    assert [c.name for c in steps[1].calls] == [c.name for c in steps[3].calls]


def test_hf_callback_bounds_and_closing_a_step_when_train_raises():
    pytest.importorskip("transformers")
    from tracer.integrations.hf import TraceCallback

    class State:  # the two fields the callback reads, as the Trainer sets them
        def __init__(self, step: int) -> None:
            self.global_step, self.is_world_process_zero = step, True

    model = torch.nn.Linear(4, 2)
    cb = TraceCallback(steps="0-2", out=None, max_calls=4)
    with pytest.warns(RuntimeWarning, match="max_calls=4"):
        for step in range(3):
            cb.on_step_begin(None, State(step), None)
            model(torch.ones(3, 4)).sum().backward()
            cb.on_step_end(None, State(step + 1), None)
    assert list(cb.traces) == [0, 1] and cb.skipped == [2]
    assert [c.name for c in cb.traces[0].calls] == ["ones0", "linear0", "sum0"]
    assert [c.name for c in cb.traces[1].calls] == ["ones0"]
    assert cb.traces[1].notes[0].startswith("recording stopped at max_calls=4 (3 in earlier steps)")

    # train() raising inside a traced step: the with-block finishes the step's trace
    with pytest.raises(ValueError, match="diverged"), TraceCallback(steps="0", out=None) as cb:
        cb.on_step_begin(None, State(0), None)
        model(torch.ones(3, 4))
        raise ValueError("diverged")
    t = cb.traces[0]
    assert t.status == "failed" and t.error["type"] == "ValueError" and [c.name for c in t.calls] == ["ones0", "linear0"]


def test_a_callback_given_no_steps_traces_step_0_as_gradtrace_run_does():
    pytest.importorskip("transformers")
    from tracer.integrations.hf import TraceCallback
    from tracer.loops.steps import StepSelection

    class State:
        def __init__(self, step: int) -> None:
            self.global_step, self.is_world_process_zero = step, True

    model = torch.nn.Linear(4, 2)
    with TraceCallback(out=None) as cb:
        for step in range(2):
            cb.on_step_begin(None, State(step), None)
            model(torch.ones(3, 4)).sum().backward()
            cb.on_step_end(None, State(step + 1), None)
    assert list(cb.traces) == [0]
    assert [c.name for c in cb.traces[0].calls] == ["ones0", "linear0", "sum0"]
    # The loop's own selection still asks for a choice: tracer.trace(steps=None) is one block.
    with pytest.raises(tracer.TraceError, match="no step chosen"):
        StepSelection.parse(None, None)
    assert 0 in StepSelection.parse(None, None, first_by_default=True)
    every = StepSelection.parse(None, 3, first_by_default=True)  # every= alone is a choice: no step 0 added
    assert every.every == 3 and every.steps == frozenset()


def test_lightning_callback_traces_chosen_steps_with_gradient_accumulation(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from tracer.integrations.lightning import TraceCallback

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(20, 4), torch.randn(20, 1))
    out = os.fspath(tmp_path / "pl.gtrace")
    callback = TraceCallback(steps="2,3", out=out)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                        callbacks=[callback], default_root_dir=os.fspath(tmp_path))
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=2))

    assert callback.steps == [2, 3]
    steps = load_steps(out)
    assert list(steps) == [2, 3]
    for n, t in steps.items():
        assert t.header["step"] == n and t.status == "ok"
        assert len(t.backward_runs) == 2  # two accumulated micro-batches, one optimizer step
        assert [c.name for c in t.calls if c.api.endswith("linear")] == ["linear0", "linear1", "linear2", "linear3"]
        assert [c.name for c in t.calls if c.name.startswith("add_")] == ["add_0", "add_1", "add_2", "add_3"]
        assert t["net.0.weight"].role == "param"
