"""Root modules (called while no other module runs) are named from the code that calls them
(tracer/record/module_roots.py): a part of a model called from one of the model's methods keeps
its path in the model, and a second model in the block is prefixed by the name its caller holds
it by, not by its class."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer


def _params(t: tracer.Trace) -> list[str]:
    return sorted(n for n, r in t.tensors.items() if r.role == "param" and "@" not in n)


def test_a_gan_names_its_discriminator_and_loss_by_their_variables() -> None:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6))
    D = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    crit = nn.BCEWithLogitsLoss()
    opt_d = torch.optim.Adam(D.parameters())
    with tracer.trace(hash="none") as t:
        fake = G(torch.randn(5, 4))
        crit(D(fake.detach()), torch.zeros(5, 1)).backward()
        opt_d.step()
    assert _params(t) == sorted([n for n, _ in G.named_parameters()] + [f"D.{n}" for n, _ in D.named_parameters()])
    assert t.modules["D"] == "Sequential" and t.modules["crit"] == "BCEWithLogitsLoss"
    assert [c.module for c in t.calls if c.api == "torch.nn.functional.linear"] == ["0", "3", "D.0", "D.2"]
    adam = next(c for c in t.calls if c.kind == "optimizer")
    assert adam.mutated == [f"D.{n}@v1" for n, _ in D.named_parameters()]


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
        self.decoder = nn.Linear(2, 6)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.encoder(x).chunk(2, -1)
        return mu, logvar

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)


def test_parts_called_from_the_models_own_methods_keep_their_paths_in_it() -> None:
    torch.manual_seed(0)
    vae = VAE()
    x = torch.randn(3, 6)
    with tracer.trace(hash="none") as t:
        mu, logvar = vae.encode(x)  # forward never runs: encode calls self.encoder
        z = mu + (0.5 * logvar).exp() * torch.randn_like(mu)
        F.mse_loss(vae.decode(z), x).backward()
    assert t.modules[""] == "VAE" and t.modules["encoder.0"] == "Linear"
    assert _params(t) == sorted(n for n, _ in vae.named_parameters())
    assert "encoder.0.weight@grad" in t.tensors and "decoder.bias@grad" in t.tensors


class Distiller:
    """A plain trainer object (not a module) holding two models."""

    def __init__(self) -> None:
        self.teacher = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 4)).eval()
        self.student = nn.Sequential(nn.Linear(6, 4))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            soft = F.softmax(self.teacher(x) / 2, -1)
        return F.kl_div(F.log_softmax(self.student(x) / 2, -1), soft, reduction="batchmean")


def test_a_second_model_held_by_a_trainer_object_is_named_by_its_attribute() -> None:
    torch.manual_seed(0)
    d = Distiller()
    with tracer.trace(hash="none") as t:
        d.loss(torch.randn(5, 6)).backward()
    assert _params(t) == sorted([n for n, _ in d.teacher.named_parameters()] + ["student.0.bias", "student.0.weight"])
    assert "student.0.weight@grad" in t.tensors


def test_a_root_with_no_name_or_a_taken_one_is_prefixed_by_its_class() -> None:
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(3, 3))
    with tracer.trace(hash="none") as t:
        y = first(torch.randn(2, 3))
        y = nn.Linear(3, 3)(y)  # held by no name
        y = nn.Linear(3, 3)(y)
    assert t.modules == {"": "Sequential", "0": "Linear", "Linear": "Linear", "Linear#1": "Linear"}
    model = nn.Sequential(OrderedDict(head=nn.Linear(3, 3)))
    head = nn.Linear(3, 3)  # its name is a path of the first root already
    with tracer.trace(hash="none") as t:
        head(model(torch.randn(2, 3)))
    assert t.modules == {"": "Sequential", "head": "Linear", "Linear": "Linear"}
    assert [c.module for c in t.calls if c.api == "torch.nn.functional.linear"] == ["head", "Linear"]


def test_a_part_called_through_its_model_or_by_torch_is_named_in_that_model() -> None:
    from torch.utils.checkpoint import checkpoint_sequential

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(4)])
    x = torch.randn(2, 4, requires_grad=True)
    with tracer.trace(hash="none") as t:
        checkpoint_sequential(model, 2, x, use_reentrant=False).sum().backward()  # calls model[0] ... model[3]
    assert _params(t) == sorted(n for n, _ in model.named_parameters())
    vae = VAE()
    with tracer.trace(hash="none") as t:
        vae.encoder(torch.randn(2, 6))  # no name of its own here: vae holds it
    assert _params(t) == sorted(n for n, _ in vae.encoder.named_parameters(prefix="encoder"))


def test_a_model_called_by_its_own_name_is_the_root_even_inside_an_averaged_copy() -> None:
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    ema = AveragedModel(model)  # holds model as .module
    with tracer.trace(hash="none") as t:
        model(torch.randn(2, 3)).sum().backward()
        ema.update_parameters(model)
    assert {"0.weight", "2.bias", "0.weight@grad"} <= set(t.tensors)
    assert t.modules[""] == "Sequential"


def _forward_keeping_locals(model: nn.Module, x: torch.Tensor) -> dict[str, object]:
    kept = locals()  # the function's own namespace dict, held across the traced call
    with tracer.trace(hash="none"):
        model(x)
    return kept


def test_the_callers_locals_are_read_without_keeping_its_tensors_or_emptying_its_locals() -> None:
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3))
    x = torch.randn(2, 3)
    kept = _forward_keeping_locals(model, x)  # a dict the program holds is left whole
    assert kept["model"] is model and kept["x"] is x
    with tracer.trace(hash="none"):
        y = torch.randn(2, 3)
        model(y)  # this frame's locals are read here, y among them
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None  # and not kept alive by a snapshot of them


def test_an_ema_met_through_its_own_update_method_is_named_by_its_callers_variable() -> None:
    """The EMA's parameters are first met inside ``ema.update(model)`` (its frame holds it as
    ``self``): the name comes from the frame that called it."""
    import copy

    class ModelEma(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.module = copy.deepcopy(model).requires_grad_(False)

        @torch.no_grad()
        def update(self, model: nn.Module) -> None:
            torch._foreach_lerp_(list(self.module.parameters()), list(model.parameters()), 0.1)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    ema = ModelEma(model)
    with tracer.trace(hash="none") as t:
        model(torch.randn(2, 3)).sum().backward()
        ema.update(model)
    assert t.modules["ema"] == "ModelEma" and t.modules["ema.module.0"] == "Linear"
    assert {"ema.module.0.weight", "ema.module.0.weight@v1", "0.weight"} <= set(t.tensors)
