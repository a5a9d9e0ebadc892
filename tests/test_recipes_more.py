"""More training recipes, each traced with checksums and compared with an identical untraced run:
the traced run ends with the same parameters to the bit, and every parameter's last record and
every gradient's last record hold the checksum of the parameter's and its ``.grad``'s bytes at
the end (``hashlib``). LBFGS (a closure: forward and backward inside ``step``), weight and
spectral norm parametrizations with their cache, a channels-last CNN with BatchNorm and an EMA
``AveragedModel``, LSTM/GRU with value clipping, a gradient penalty with ``retain_graph``, an
encoder-decoder (T5), a ViT with a OneCycle schedule and ``zero_grad(set_to_none=False)``, a
``TransformerEncoder`` with AMSGrad and its inference fast path, a packed bidirectional LSTM
under attention with Adagrad, quantization-aware training (fake quantization, BatchNorm), a VAE's
reparameterised sample with a complex FFT filter and NAdam, fp32 master weights copied back
into a bf16 model through ``.data``, and SWA with ``update_bn``."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer
from tests.models import traced_twin
from tracer.model.phases import CLOSURE_STEP_NOTE
from tracer.record.modules import SLOW_PATH_NOTE

Recipe = Callable[[], tuple[nn.Module, Callable[[], None]]]


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _last(t: tracer.Trace, base: str) -> tracer.TensorRecord | None:
    """The last record of ``base`` and its versions (``base@v2``), or of its gradients
    (``base@grad``, ``base@grad#1``, ``base@grad@v1``) when ``base`` ends with ``@grad``."""
    found = [r for n, r in t.tensors.items()
             if n == base or n.startswith(base + "@v") or (base.endswith("@grad") and n.startswith(base + "#"))]
    return max(found, key=lambda r: r.seq, default=None)


def lbfgs() -> tuple[nn.Module, Callable[[], None]]:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=4)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return model, lambda: opt.step(closure)  # type: ignore[func-returns-value]


def parametrized() -> tuple[nn.Module, Callable[[], None]]:
    from torch.nn.utils import parametrizations, parametrize

    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(6, 6)), nn.ReLU(),
                          parametrizations.spectral_norm(nn.Linear(6, 3)))
    x = torch.randn(4, 6)
    opt = torch.optim.Adam(model.parameters())

    def step() -> None:
        with parametrize.cached():
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    return model, step


def channels_last_ema() -> tuple[nn.Module, Callable[[], None]]:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2),
                        nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    net = net.to(memory_format=torch.channels_last)
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    x = torch.randn(4, 3, 10, 10).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)

    def step() -> None:
        for _ in range(2):
            F.cross_entropy(net(x), torch.tensor([0, 1, 2, 0])).backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(net)

    return net, step


def recurrent() -> tuple[nn.Module, Callable[[], None]]:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.lstm = nn.LSTM(16, 24, num_layers=2, batch_first=True, dropout=0.1)
            self.gru = nn.GRU(24, 8, bidirectional=True, batch_first=True)
            self.head = nn.Linear(16, 50)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h, _ = self.lstm(self.emb(ids))
            h, _ = self.gru(h)
            return self.head(h)

    model = Model()
    ids = torch.randint(0, 50, (3, 7))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)

    def step() -> None:
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        opt.step()

    return model, step


def gradient_penalty() -> tuple[nn.Module, Callable[[], None]]:
    model = nn.Sequential(nn.Linear(3, 16), nn.Softplus(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(5, 3, requires_grad=True)

    def step() -> None:
        y = model(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (y.mean() + (g.norm(dim=1) - 1).pow(2).mean()).backward(retain_graph=True)
        (y.mean() * 0.5).backward()
        opt.step()

    return model, step


def t5() -> tuple[nn.Module, Callable[[], None]]:
    tf = pytest.importorskip("transformers")
    model = tf.T5ForConditionalGeneration(tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, d_kv=8,
                                                      num_heads=4, vocab_size=100, decoder_start_token_id=0,
                                                      pad_token_id=0)).train()
    x, labels = torch.randint(0, 100, (2, 8)), torch.randint(1, 100, (2, 6))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> None:
        model(input_ids=x, labels=labels).loss.backward()
        opt.step()

    return model, step


def vit() -> tuple[nn.Module, Callable[[], None]]:
    tf = pytest.importorskip("transformers")
    model = tf.ViTForImageClassification(tf.ViTConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                      num_attention_heads=2, image_size=16, patch_size=4,
                                                      num_labels=5)).train()
    x, labels = torch.randn(2, 3, 16, 16), torch.tensor([1, 4])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)

    def step() -> None:
        for _ in range(2):
            model(pixel_values=x, labels=labels).loss.backward()
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=False)

    return model, step


def transformer_encoder() -> tuple[nn.Module, Callable[[], None]]:
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True, norm_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(16, 3))
    x = torch.randn(2, 5, 16)
    opt = torch.optim.Adam(model.parameters(), amsgrad=True)

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        model.eval()  # the encoder's inference fast path, under no_grad
        with torch.no_grad():
            model(x)
        model.train()

    return model, step


def packed_lstm_attention() -> tuple[nn.Module, Callable[[], None]]:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.lstm = nn.LSTM(8, 8, batch_first=True, bidirectional=True)
            self.att = nn.MultiheadAttention(16, 2, batch_first=True)
            self.out = nn.Linear(16, 2)

        def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
            h, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True)
            a, _ = self.att(h, h, h, need_weights=True)
            return self.out(a.mean(1))

    model = Model()
    ids, lengths = torch.randint(0, 20, (3, 6)), torch.tensor([6, 3, 4])
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)

    def step() -> None:
        F.cross_entropy(model(ids, lengths), torch.tensor([0, 1, 1])).backward()
        opt.step()
        opt.zero_grad()

    return model, step


def quantization_aware() -> tuple[nn.Module, Callable[[], None]]:
    import torch.ao.quantization as q

    model = nn.Sequential(q.QuantStub(), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 2), q.DeQuantStub())
    model.train()
    model.qconfig = q.get_default_qat_qconfig("fbgemm")  # type: ignore[assignment]
    q.prepare_qat(model, inplace=True)
    x = torch.randn(2, 3, 8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, step


def vae_spectral() -> tuple[nn.Module, Callable[[], None]]:
    class Model(nn.Module):
        """A VAE's reparameterised sample and KL term, then a complex-weighted FFT filter."""

        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(6, 8)
            self.dec = nn.Linear(2, 8)
            self.filter = nn.Parameter(torch.randn(5, dtype=torch.cfloat) * 0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.enc(x)
            qz = torch.distributions.Normal(h[:, :2], (0.5 * h[:, 2:4]).exp())
            kl = torch.distributions.kl_divergence(qz, torch.distributions.Normal(0.0, 1.0)).sum(-1).mean()
            y = torch.fft.irfft(torch.fft.rfft(self.dec(qz.rsample())) * self.filter, n=8)
            return F.mse_loss(y[:, :6], x) + kl

    model = Model()
    x = torch.randn(4, 6)
    opt = torch.optim.NAdam(model.parameters(), foreach=True, decoupled_weight_decay=True)

    def step() -> None:
        model(x).backward()
        opt.step()
        opt.zero_grad()

    return model, step


def master_weights() -> tuple[nn.Module, Callable[[], None]]:
    """bf16 model, fp32 master copies stepped by the optimizer and copied back through .data."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.bfloat16)
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    master = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.Adam(master, lr=1e-2)

    def step() -> None:
        for _ in range(2):
            model(x).float().pow(2).mean().backward()
            for mp, p in zip(master, model.parameters()):
                assert p.grad is not None
                mp.grad = p.grad.float()
                p.grad = None
            opt.step()
            opt.zero_grad()
            for mp, p in zip(master, model.parameters()):
                p.data.copy_(mp.data)

    return model, step


def swa_update_bn() -> tuple[nn.Module, Callable[[], None]]:
    from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(6, 4)
    swa = AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = SWALR(opt, swa_lr=0.05)

    def step() -> None:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            swa.update_parameters(model)
            schedule.step()
        update_bn([(x[:3],), (x[3:],)], swa)

    return model, step


RECIPES: dict[str, Recipe] = {f.__name__: f for f in (lbfgs, parametrized, channels_last_ema, recurrent,
                                                     gradient_penalty, t5, vit, transformer_encoder,
                                                     packed_lstm_attention, quantization_aware, vae_spectral,
                                                     master_weights, swa_update_bn)}


@pytest.mark.parametrize("hash_kind", ["md5", "none"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_recipe_ends_as_untraced_and_its_last_records_hold_the_end_values(recipe: str, hash_kind: str) -> None:
    plain, model, t = traced_twin(RECIPES[recipe], hash=hash_kind)
    assert t.status == "ok" and t.backward_runs
    # (the encoder recipe's no_grad eval pass: PyTorch skips its fused path under the trace)
    notes = {"transformer_encoder": [SLOW_PATH_NOTE.format(cls="TransformerEncoder")],
             "lbfgs": [CLOSURE_STEP_NOTE.format(cls="LBFGS")]}
    assert t.notes == notes.get(recipe, [])
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
        if hash_kind == "none":
            continue
        last = _last(t, name)
        assert last is not None and last.md5 == _md5(p), name
        if p.grad is not None:
            grad = _last(t, f"{name}@grad")
            assert grad is not None and grad.md5 == _md5(p.grad), name
