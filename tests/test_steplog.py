"""The step log (``.gtsteps``): what one optimizer step writes (checked against the reference
fingerprint, ``torch``'s norms and the exact loss), parameters named in execution order, a log
that survives a kill, no snapshot, the watch's log with a replayed step written once, the HF
Trainer and Lightning callbacks counting optimizer steps (not micro-batches), ``gradtrace run
--log``, a fault of the log that leaves the training running, and hostile files refused with one
line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch
import torch.nn as nn

import tracer
from export.cli import main
from tests.watch_models import gpt2_batches, gpt2_train_step, tiny_gpt2
from tracer.features.steplog.inputs import digest, rng_digests
from tracer.model.steplog import NO_GRAD, StepLogFormatError, StepLogReader, read_steplog
from tracer.record.checksums.fingerprint import fingerprint_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("one_thread")


class TwoLayers(nn.Module):
    """Registered b then a, run a then b: the log lists a's parameters first."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(8, 2)
        self.a = nn.Linear(4, 8)
        self.frozen = nn.Linear(2, 2)  # never called: its parameters come last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _fp(t: torch.Tensor) -> str:
    return fingerprint_reference(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def test_each_optimizer_step_writes_its_loss_lr_and_the_fingerprints_the_optimizer_read(tmp_path):
    torch.manual_seed(0)
    model = TwoLayers()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seen: list[dict[str, object]] = []

    def reference(optimizer, args, kwargs):  # what the optimizer reads, as the log sees it
        seen.append({n: (_fp(p), _fp(p.grad) if p.grad is not None else None,
                         float(torch.linalg.vector_norm(p.detach())), None if p.grad is None else
                         float(torch.linalg.vector_norm(p.grad))) for n, p in model.named_parameters()})

    log = tracer.step_log(tmp_path / "run.gtsteps")
    opt.register_step_pre_hook(reference)
    losses, batches = [], []
    for _ in range(4):
        x = torch.randn(3, 4)
        batches.append(x)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    log.close()
    got = read_steplog(tmp_path / "run.gtsteps")
    names = [p.name for p in got.layouts[0].params]
    assert names == ["a.weight", "a.bias", "b.weight", "b.bias", "frozen.weight", "frozen.bias"]
    assert [p.shape for p in got.layouts[0].params] == [(8, 4), (8,), (2, 8), (2,), (2, 2), (2,)]
    assert got.ended and not got.truncated and got.version == 1 and got.fingerprint == "gtfp2-fmix32x2-64"
    assert [s.step for s in got.steps] == [0, 1, 2, 3]
    for s, ref, loss, x in zip(got.steps, seen, losses, batches):
        assert s.params == [ref[n][0] for n in names]  # type: ignore[index]
        assert s.grads == [ref[n][1] for n in names]  # type: ignore[index]
        assert s.grads[-1] is None  # the frozen layer never got a gradient
        assert s.param_norms == pytest.approx([ref[n][2] for n in names], rel=1e-6)  # type: ignore[index]
        assert s.loss == [loss] and (s.backward, s.forward, s.batch_tensors) == (1, 1, 1)
        assert s.lr == [3e-3] and set(s.rng) >= {"torch", "python"}
        assert s.batch == digest(f"float32[3, 4]:{_fp(x)};".encode())
    final = got.finals[0]
    assert final.params == [_fp(p) for p in (model.a.weight, model.a.bias, model.b.weight, model.b.bias,
                                              model.frozen.weight, model.frozen.bias)]
    line = (tmp_path / "run.gtsteps").read_text().splitlines()[2]
    assert NO_GRAD in json.loads(line)["grads"]


def test_a_module_first_called_outermost_after_the_first_step_is_seen(tmp_path):
    """After its first step the log hooks only the outermost module running (the others take
    PyTorch's fast call path); a model the loop first calls at step 2, before the model, is
    still seen: its call is a forward, its input is in the batch, and the random states are
    those as it began (its dropout draws before the model runs). A forward that raises ends its
    call (the calls after it are seen), and a call on another thread is not counted."""
    torch.manual_seed(0)
    model = TwoLayers()
    teacher = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tracer.step_log(tmp_path / "run.gtsteps", model=model, optimizer=opt)
    batches: list[list[torch.Tensor]] = []
    rngs = []
    for step in range(4):
        x = torch.randn(3, 4)
        rngs.append(rng_digests())
        given = [x]
        if step >= 2:
            hint = torch.randn(3, 4)
            rngs[-1] = rng_digests()
            teacher(hint)  # outermost, first: a module the log has never seen
            given = [hint, x]
        loss = model(x).square().mean()
        if step == 3:
            wrong = torch.randn(3, 5)
            with pytest.raises(RuntimeError):
                model.a(wrong)  # raises inside its forward
            later = torch.randn(2, 4)
            with torch.no_grad():
                model(later)
            elsewhere = threading.Thread(target=lambda: model(torch.randn(1, 4)))
            elsewhere.start()
            elsewhere.join()
            given += [wrong, later]
        batches.append(given)
        loss.backward()
        opt.step()
        opt.zero_grad()
    log.close()
    got = read_steplog(tmp_path / "run.gtsteps")
    assert [s.forward for s in got.steps] == [1, 1, 2, 4]
    assert [s.batch_tensors for s in got.steps] == [1, 1, 2, 4]
    for s, given, rng in zip(got.steps, batches, rngs):
        assert s.batch == digest(*(f"float32{list(t.shape)}:{_fp(t)};".encode() for t in given))
        assert s.rng == rng


def test_the_log_alone_takes_no_snapshot(tmp_path, monkeypatch):
    from tracer.features.watch import snapshot

    def refuse(*args, **kwargs):
        raise AssertionError("the step log took a snapshot")

    monkeypatch.setattr(snapshot.StateSnapshot, "capture", refuse)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.step_log(tmp_path / "run.gtsteps", model=model, optimizer=opt) as log:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert log.steps == 3 and len(read_steplog(log.path).steps) == 3


def test_a_sparse_gradient_is_logged_without_a_fingerprint(tmp_path):
    table = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(table.parameters(), lr=0.1)
    with tracer.step_log(tmp_path / "run.gtsteps", model=table, optimizer=opt):
        for _ in range(2):
            table(torch.tensor([1, 2, 2])).sum().backward()
            opt.step()
            opt.zero_grad()
    got = read_steplog(tmp_path / "run.gtsteps")
    assert [(s.grads, s.grad_norms) for s in got.steps] == [([None], [None])] * 2  # sparse: no plain bytes
    assert got.finals[0].params == [_fp(table.weight)]
    assert got.steps[0].params[0] != got.steps[1].params[0]  # the sparse update shows in the dense weight


KILLED = textwrap.dedent("""
    import os, signal, sys, torch
    import tracer
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer.step_log(sys.argv[1])
    for step in range(100):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 6:
            os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_program_leaves_every_step_written_before_the_kill(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, os.fspath(script), os.fspath(tmp_path / "run.gtsteps")], env=env)
    assert done.returncode == -signal.SIGKILL
    got = read_steplog(tmp_path / "run.gtsteps")
    assert [s.step for s in got.steps] == list(range(7)) and not got.ended and not got.finals
    # A kill in the middle of a line: the line is dropped, the steps before it are kept.
    with open(tmp_path / "run.gtsteps", "ab") as fh:
        fh.write(b'{"t":"step","step":7,"opt":0,"loss":[0.5')
    cut = read_steplog(tmp_path / "run.gtsteps")
    assert len(cut.steps) == 7 and cut.truncated


def test_a_watch_logs_every_step_once_even_the_replayed_one(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = tracer.watch(model, opt, out=tmp_path / "incident.gtrace", policy="skip",
                        log=tmp_path / "run.gtsteps")(gpt2_train_step(model, opt))
    for ids, keep in gpt2_batches(6, bad_step=3):
        step(ids, keep)
    step.watch.close()
    assert [i.step for i in step.watch.incidents] == [3]
    got = read_steplog(tmp_path / "run.gtsteps")
    assert [s.step for s in got.steps] == list(range(6)) and got.ended
    assert got.meta["writer"] == "tracer.watch"
    assert [p.name for p in got.layouts[0].params][:3] == ["transformer.wte.weight", "transformer.wpe.weight",
                                                           "transformer.h.0.ln_1.weight"]
    import math
    assert math.isnan(got.steps[3].loss[0]) and all(math.isfinite(s.loss[0]) for s in got.steps if s.step != 3)
    # policy="skip" put the state back: step 4 starts from the parameters step 3 started from
    assert got.steps[4].params == got.steps[3].params


def test_hf_trainer_with_gradient_accumulation_logs_optimizer_steps(tmp_path):
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tracer.integrations.hf import StepLogCallback, WatchCallback

    torch.manual_seed(0)
    ids = torch.randint(1, 32, (12, 8), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": row, "labels": row} for row in ids]
    logs = {}
    for name, cb in (("log", StepLogCallback(tmp_path / "hf.gtsteps")),
                     ("watch", WatchCallback(out=None, log=tmp_path / "watch.gtsteps"))):
        args = tf.TrainingArguments(output_dir=os.fspath(tmp_path / name), max_steps=3, per_device_train_batch_size=2,
                                    gradient_accumulation_steps=2, report_to=[], save_strategy="no",
                                    logging_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
                                    seed=0, data_seed=0)
        torch.manual_seed(0)
        trainer = tf.Trainer(model=tiny_gpt2(), args=args, train_dataset=data, callbacks=[cb])
        trainer.train()
        logs[name] = read_steplog(tmp_path / ("hf.gtsteps" if name == "log" else "watch.gtsteps"))
    for got in logs.values():
        assert [s.step for s in got.steps] == [0, 1, 2] and got.ended  # 3 optimizer steps, not 6 micro-batches
        assert all((s.backward, s.forward, len(s.loss)) == (2, 2, 2) for s in got.steps)
        assert all(s.batch_tensors >= 4 for s in got.steps)  # input_ids and labels of both micro-batches
        assert got.layouts[0].params[0].name == "transformer.wte.weight"
    assert [s.loss for s in logs["log"].steps] == [s.loss for s in logs["watch"].steps]


def test_lightning_step_log_callback_counts_optimizer_steps(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from tracer.integrations.lightning import StepLogCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    cb = StepLogCallback(tmp_path / "pl.gtsteps")
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=2))
    got = read_steplog(tmp_path / "pl.gtsteps")
    assert [s.step for s in got.steps] == [0, 1, 2] and got.ended
    assert all((s.backward, len(s.loss)) == (2, 2) for s in got.steps)
    assert [p.name for p in got.layouts[0].params] == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


def test_a_step_with_a_closure_is_logged_once_with_the_gradients_the_closure_made(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    calls = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        calls.append((loss.item(), _fp(model.weight.grad)))
        return loss

    starts = []
    with tracer.step_log(tmp_path / "run.gtsteps", optimizer=opt):
        for _ in range(2):
            starts.append(len(calls))
            opt.step(closure)
    got = read_steplog(tmp_path / "run.gtsteps")
    assert len(calls) > 2 and [s.step for s in got.steps] == [0, 1]  # L-BFGS calls it again: one step each
    for s, start in zip(got.steps, starts):  # the first call of the step: its loss and gradient
        assert (s.loss, s.grads[0], s.backward) == ([calls[start][0]], calls[start][1], 1)


PROGRAM = textwrap.dedent("""
    import sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(int(sys.argv[1])):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
""")


def test_gradtrace_run_log_writes_the_log_and_traces_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(PROGRAM)
    assert main(["run", "--log", "train.gtsteps", "train.py", "5"]) == 0
    err = capsys.readouterr().err
    assert "gradtrace: logged 5 steps of train.py -> train.gtsteps" in err
    assert not (tmp_path / "train.gtrace").exists()
    got = read_steplog(tmp_path / "train.gtsteps")
    assert len(got.steps) == 5 and got.meta["argv"] == ["train.py", "5"] and got.meta["module"] is False
    assert got.meta["writer"] == "gradtrace run" and got.meta["cwd"] == os.fspath(tmp_path)
    assert [p.name for p in got.layouts[0].params] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # with --steps, the same log beside the traced step
    assert main(["run", "--log", "again.gtsteps", "--steps", "2", "-o", "two.gtrace", "train.py", "5"]) == 0
    again = read_steplog(tmp_path / "again.gtsteps")
    assert [s.params for s in again.steps] == [s.params for s in got.steps]  # tracing step 2 changed nothing
    assert tracer.load(tmp_path / "two.gtrace").header["step"] == 2


def test_a_fault_of_the_log_stops_the_log_not_the_training(tmp_path, monkeypatch):
    from tracer.features.steplog import recorder

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tracer.step_log(tmp_path / "run.gtsteps", model=model, optimizer=opt)
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd, data):
        calls["n"] += 1
        if calls["n"] > 4:  # the layout, steps 0, 1 and 2; then the disk is full
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(recorder.os, "write", failing_write)
    with pytest.warns(RuntimeWarning, match="the step log .* stopped after 3 steps written: OSError"):
        for _ in range(5):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    monkeypatch.setattr(recorder.os, "write", real_write)
    assert log.failed is not None and log.closed
    log.close()  # removes the hooks (the conftest fixture checks that none is left)
    assert [s.step for s in read_steplog(tmp_path / "run.gtsteps").steps] == [0, 1, 2]


# ---- a log is untrusted input ------------------------------------------------------------------
HEADER = '{"t":"steplog","format":"gradtrace-steps","version":1,"fingerprint":"gtfp2-fmix32x2-64","meta":{}}'
LAYOUT = '{"t":"layout","opt":0,"params":[["w",[2],"float32"]]}'
STEP = ('{"t":"step","step":0,"opt":0,"loss":[1.5],"backward":1,"forward":1,"batch":null,"batch_tensors":0,'
        '"rng":{},"lr":[0.1],"hyper":"","params":"0123456789abcdef","grads":"%s","param_norms":[1.0],'
        '"grad_norms":[1.0]}')


@pytest.mark.parametrize("lines, why", [
    ([b"\x80\x81 not text"], "not UTF-8"),
    ([b"not json"], "not JSON"),
    ([b'{"t":"header","format":"gradtrace","version":2}'], "not a gradtrace step log"),
    ([HEADER.replace('"version":1', '"version":9').encode()], "version 9 is newer than this gradtrace reads (version 1)"),
    ([HEADER.replace('"meta":{}', '"meta":' + "[" * 40 + "]" * 40).encode()], "nested"),
    ([HEADER.encode(), (STEP % ("f" * 16)).encode()], "before its layout"),
    ([HEADER.encode(), LAYOUT.encode(), (STEP % ("f" * 17)).encode()], "fingerprints of 16 hexadecimal digits"),
    ([HEADER.encode(), LAYOUT.encode(), (STEP % ("f" * 16)).replace('"loss":[1.5]', '"loss":["x"]').encode()],
     "'loss' must be a list of numbers"),
    ([HEADER.encode(), LAYOUT.encode(), (STEP % ("f" * 16)).replace('"step":0', '"step":-1').encode()],
     "'step' must be an integer"),
    ([HEADER.encode(), LAYOUT.encode(), (STEP % ("f" * 16)).replace('"batch":null', '"batch":"<script>"').encode()],
     "'batch' must be a digest"),
    ([b"\x80\x03cos\nsystem\nq\x00.", b""], "not UTF-8"),  # a pickle is bytes, never loaded as one
])
def test_a_bad_log_is_one_line_and_exit_status_2(tmp_path, capsys, lines, why):
    bad = tmp_path / "bad.gtsteps"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(StepLogFormatError, match=why.replace("(", r"\(").replace(")", r"\)")):
        read_steplog(bad)
    good = tmp_path / "good.gtsteps"
    good.write_text("\n".join([HEADER, LAYOUT, STEP % ("e" * 16)]) + "\n")
    assert main(["bisect", os.fspath(good), os.fspath(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gradtrace bisect: error: ") and "bad.gtsteps" in err


def test_a_line_over_the_limit_is_refused_without_reading_it_whole(tmp_path):
    big = tmp_path / "big.gtsteps"
    big.write_bytes(HEADER.encode() + b"\n" + b'{"t":"layout","opt":0,"params":[' + b" " * 5000 + b"]}\n")
    with pytest.raises(StepLogFormatError, match="longer than 1,000 bytes"), StepLogReader(big, max_line=1000) as r:
        list(r)


def test_reading_logs_imports_no_torch(tmp_path):
    log = tmp_path / "a.gtsteps"
    log.write_text("\n".join([HEADER, LAYOUT, STEP % ("e" * 16)]) + "\n")
    code = ("import sys; from export.cli.main import main; rc = main(['bisect', sys.argv[1], sys.argv[1]]); "
            "print(rc, 'torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code, os.fspath(log)], capture_output=True, text=True, env=env,
                         check=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "0 False"


DEVICE_PATH = textwrap.dedent("""
    import os, sys, torch
    import tracer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(torch.float64)
    model[0].to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    # the CPU path, then the device path through the kernels, then through torch's lane sums
    for name, interpret, triton in (("host", "0", "1"), ("kernels", "1", "1"), ("lanes", "1", "0")):
        os.environ.update(GRADTRACE_FUSED_INTERPRET=interpret, GRADTRACE_TRITON=triton)
        model.load_state_dict(start)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        with tracer.step_log(os.path.join(sys.argv[1], name + ".gtsteps"), model=model, optimizer=opt):
            for step in range(2):
                x = torch.randn(4, 6, dtype=torch.bfloat16)
                model[2](model[1](model[0](x)).double()).square().mean().backward()
                opt.step()
                opt.zero_grad()
""")


def test_the_device_path_logs_what_the_cpu_path_logs(tmp_path):
    """The CUDA path (the batched kernels, or torch's lane sums without Triton; the results copied
    to the host in one piece) run on CPU tensors under Triton's interpreter writes the same log."""
    pytest.importorskip("triton")
    script = tmp_path / "train.py"
    script.write_text(DEVICE_PATH)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, os.fspath(script), os.fspath(tmp_path)], env=env, check=True)
    host, *device = (read_steplog(tmp_path / f"{n}.gtsteps") for n in ("host", "kernels", "lanes"))
    assert len(host.steps) == 2 and host.steps[0].params != host.steps[1].params
    for other in device:
        assert [(s.params, s.grads, s.batch, s.loss) for s in host.steps] == \
            [(s.params, s.grads, s.batch, s.loss) for s in other.steps]
        assert host.finals[0].params == other.finals[0].params
        # The norms (for comparisons within a tolerance) are summed in another order by the kernel:
        # equal to float32's precision (the bfloat16 layer's too: accumulated in float32, not
        # rounded to bfloat16), and none missing.
        for a, b in zip(host.steps, other.steps):
            for mine, theirs in ((a.param_norms, b.param_norms), (a.grad_norms, b.grad_norms)):
                assert None not in mine and mine == pytest.approx(theirs, rel=1e-6)
        assert host.finals[0].param_norms == pytest.approx(other.finals[0].param_norms, rel=1e-6)


def test_a_log_started_before_the_process_group_is_one_per_rank_under_a_launcher(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gradtrace run --log`` under torchrun starts the log before the program sets up its
    process group: the launcher's environment says the rank, so each rank writes its own
    ``run.rank<k>.gtsteps`` (before, both truncated and appended to one file, which was refused)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    log = tracer.StepLog(str(tmp_path / "run.gtsteps"))
    log.start()
    try:
        assert log.path == str(tmp_path / "run.rank1.gtsteps")
    finally:
        log.close()
    assert os.path.exists(tmp_path / "run.rank1.gtsteps") and not os.path.exists(tmp_path / "run.gtsteps")
    read_steplog(str(tmp_path / "run.rank1.gtsteps"))
