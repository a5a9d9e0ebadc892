"""Names when the traced step is a script's first (``gradtrace run`` traces step 0 from the
script's start): the model is built, initialised and called inside the block, a transform
module (no parameters) may run before it, and a GAN's generator may be met only from the
discriminator's graph. Found running pytorch/examples scripts unmodified."""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

import tracer


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv1(x))).flatten(1))


def test_a_model_built_in_the_block_after_a_transform_keeps_its_paths() -> None:
    torch.manual_seed(0)
    with tracer.trace(hash="md5") as t:
        normalize = nn.Identity()  # a transform module, called first
        model = Net()  # its constructor initialises every parameter (kaiming_uniform_, ...)
        opt = torch.optim.Adadelta(model.parameters())
        x = normalize(torch.randn(2, 1, 8, 8))
        nn.functional.cross_entropy(model(x), torch.tensor([0, 2])).backward()
        opt.step()
    assert t.modules[""] == "Net" and t.modules["normalize"] == "Identity"
    step = next(c for c in t.calls if c.kind == "optimizer")
    names = [n for n, _ in model.named_parameters()]
    assert step.inputs == [x for n in names for x in (n, f"{n}@grad")]
    for n, p in model.named_parameters():
        rec = t.tensors[n]
        assert rec.role == "param" and rec.previous is not None
        before = t.tensors[rec.previous]  # the value the constructor's initialiser wrote
        assert before.md5 == rec.md5 and before.producer is not None
        assert f"{n}/AccumulateGrad" in {g.name for g in t.grad_nodes}
        last = max((r for k, r in t.tensors.items() if k == n or k.startswith(n + "@v")), key=lambda r: r.seq)
        assert last.md5 == _md5(p)
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= set(t.tensors)
    # The bytes nn.Parameter(torch.empty(...)) held before its initialiser are not hashed (they
    # were garbage: a NaN among them was reported in a healthy run).
    garbage = [r for r in t.tensors.values() if r.hash_note and "first seen being overwritten" in r.hash_note]
    assert garbage and all(r.md5 is None and r.stats is None and r.uninitialized for r in garbage)
    assert not any(r.stats is not None and (r.stats.nan or r.stats.inf) for r in t.tensors.values())


def test_a_generator_met_from_the_discriminators_graph_is_named_by_its_variable() -> None:
    torch.manual_seed(0)
    netG, netD = nn.Linear(2, 4), nn.Linear(4, 1)
    optD = torch.optim.SGD(netD.parameters(), lr=0.1)
    optG = torch.optim.SGD(netG.parameters(), lr=0.1)
    fake = netG(torch.randn(3, 2))  # (the step before: the generator's forward)
    netD(fake.detach()).mean().backward()
    optD.step()
    with tracer.trace(hash="md5") as t:
        netG.zero_grad()
        netD(fake).mean().backward()  # reaches the generator's leaves from the discriminator's graph
        optG.step()
    step = next(c for c in t.calls if c.kind == "optimizer")
    assert step.inputs == ["netG.weight", "netG.weight@grad", "netG.bias", "netG.bias@grad"]
    assert t.modules == {"": "Linear", "netG": "Linear"}
    assert t.tensors["netG.weight@v1"].md5 == _md5(netG.weight)


def test_a_deep_generator_met_from_the_discriminators_graph_keeps_its_variable() -> None:
    # (pytorch/examples dcgan: the walk over the generator's graph, made in the step before, was
    # recursive, and the frames it took hid the script's variable: Sequential.0.weight)
    torch.manual_seed(0)
    netG = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(12)])
    netD = nn.Linear(4, 1)
    optG = torch.optim.SGD(netG.parameters(), lr=0.1)
    fake = netG(torch.randn(3, 4))
    with tracer.trace(hash="md5") as t:
        netD(fake).mean().backward()
        optG.step()
    step = next(c for c in t.calls if c.kind == "optimizer")
    assert step.inputs[:4] == ["netG.0.weight", "netG.0.weight@grad", "netG.1.weight", "netG.1.weight@grad"]


def test_a_graph_thousands_of_nodes_deep_made_before_the_block() -> None:
    # A hidden state carried over from earlier steps: the walk over it raised RecursionError
    # (recording stopped, nothing recorded) from about 500 nodes deep.
    lin = nn.Linear(4, 4)
    h = torch.randn(2, 4, requires_grad=True)
    for _ in range(3000):
        h = torch.tanh(h)
    with tracer.trace(hash="none") as t:
        lin(h).mean().backward()
    assert not t.notes and [c.name for c in t.calls] == ["linear0", "mean0"]
    external = [n for n in t.grad_nodes if n.external and n.kind == "TanhBackward0"]
    assert len(external) == 3000
    assert all(n.next[0] is not None for n in external)  # each linked to the one before it
