"""A detection-style training step whose tensors' version counters tests compare, traced and
not (issue 45, item 6): the patterns of torchvision's Faster R-CNN that moved ``p.grad._version``
under a trace, without torchvision.

- frozen batch norm (``FrozenBatchNorm2d``: statistics and affine parameters as buffers);
- images batched by copying each into a view of a zero tensor (``batch_images``), an in-place
  ReLU, an in-place write through a view of an intermediate;
- one head shared by every feature level (the RPN head): autograd sums its weight's gradient
  from several edges, in place where nobody else holds the first one;
- a ``.data`` write, GradScaler's unscale, clipping, AdamW.

Used by tests/test_hardening_versions.py (CPU) and tests/fused_interpreted.py (the batched CUDA
path under Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class FrozenBatchNorm2d(nn.Module):
    """torchvision's: batch norm with its statistics and affine parameters fixed (buffers)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(n))
        self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        bias = self.bias - self.running_mean * scale
        return x * scale.reshape(1, -1, 1, 1) + bias.reshape(1, -1, 1, 1)


class DetectorLike(nn.Module):
    """A stem with frozen batch norm, a lateral conv, and a head shared by three levels."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.stem_bn = FrozenBatchNorm2d(8)
        self.lateral = nn.Conv2d(8, channels, 1)
        self.head = nn.Conv2d(channels, channels, 3, padding=1)
        self.cls = nn.Conv2d(channels, 3, 1)

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        height = max(i.shape[1] for i in images)
        width = max(i.shape[2] for i in images)
        batched = images[0].new_full((len(images), 3, height, width), 0.0)
        for img, pad in zip(images, batched):
            pad[:, :img.shape[1], :img.shape[2]].copy_(img)
        x = self.lateral(self.stem_bn(self.stem(batched)).relu_())
        x[:, :2].mul_(0.5)
        levels = [x, F.max_pool2d(x, 2), F.max_pool2d(x, 4)]
        return sum((self.cls(F.relu(self.head(level))).pow(2).mean() for level in levels), torch.zeros(()))


def train_step(model: DetectorLike, opt: torch.optim.Optimizer, scaler: Any, images: list[torch.Tensor]) -> None:
    opt.zero_grad()
    with torch.no_grad():
        model.cls.bias.data.clamp_(-1.0, 1.0)
    loss = model(images)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()


def versions_after(traced: Callable[[], Any] | None, channels: int, device: str = "cpu") -> dict[str, int | None]:
    """Every parameter's, gradient's, buffer's and optimizer state tensor's version counter after
    a second step (the first makes the optimizer state), the second run under ``traced()`` (a
    context manager) or plainly. ``device``: where the model, images and scaler live."""
    torch.manual_seed(0)
    model = DetectorLike(channels).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
    g = torch.Generator().manual_seed(1)
    images = [torch.randn(3, 16, 12, generator=g).to(device), torch.randn(3, 12, 16, generator=g).to(device)]
    train_step(model, opt, scaler, images)
    if traced is None:
        train_step(model, opt, scaler, images)
    else:
        with traced():
            train_step(model, opt, scaler, images)
    out: dict[str, int | None] = {}
    for name, p in model.named_parameters():
        out[name] = p._version
        out[f"{name}.grad"] = None if p.grad is None else p.grad._version
    for name, b in model.named_buffers():
        out[name] = b._version
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{names[id(p)]}.{key}"] = value._version
    return out
