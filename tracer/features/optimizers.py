"""The optimizer under a framework's wrapper, for the features that hook or snapshot one (the
watch, the step log, the determinism check)."""

from __future__ import annotations

from typing import Any

import torch


def real_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` under wrappers that keep it as ``.optimizer`` (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``)."""
    opt = optimizer
    for _ in range(8):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            opt = inner
        else:
            break
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"not a torch.optim.Optimizer: {type(optimizer).__name__}")
    return opt
