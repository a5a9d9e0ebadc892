"""What goes into a step besides the parameters: the batch, the random number generators, and
the order in which the model runs its modules.

``ForwardInputs`` keeps two global module hooks while a step log is open (PyTorch calls them
for every module call; they do nothing but count depth, except at the outermost call):

- the pre-hook of an outermost module call (no other module running) takes the digests of the
  random number generators if it is the step's first forward, and, until the log has named the
  parameters, notes each module the first time it runs (execution order);
- the post-hook of an outermost call (it sees keyword arguments, which the global pre-hook does
  not) collects the step's batch: every tensor given to the call that nothing differentiable
  made and that is not trainable itself (token ids, labels, images, masks; not an activation
  handed from one model to another, not a parameter).

The hooks run only on the thread that opened the log.
"""

from __future__ import annotations

import hashlib
import random
import sys
import threading
from array import array
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from tracer.record.tensors import flat_tensors, remove_global_forward_hook


def digest(*parts: bytes) -> str:
    """16 hexadecimal digits of BLAKE2b over ``parts`` (a digest of host data: random states,
    hyperparameters, a batch's fingerprints)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p)
    return h.hexdigest()


def rng_digests() -> dict[str, str]:
    """A digest of each random number generator's state: torch's CPU generator, every CUDA
    device's (only once CUDA is initialised: asking would start it in a CPU-only run), Python's
    ``random`` and NumPy's global generator (only where the program imported NumPy)."""
    out = {"torch": digest(torch.get_rng_state().numpy().tobytes())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = digest(*(s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()))
    version, internal, gauss = random.getstate()
    out["python"] = digest(array("Q", internal).tobytes(), repr((version, gauss)).encode())
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            out["numpy"] = digest(keys.tobytes(), repr((kind, pos, has_gauss, cached)).encode())
        except Exception:  # a NumPy without the legacy global generator: nothing to digest
            pass
    return out


class ForwardInputs:
    """The global module hooks (see the module docstring); ``on_batch(tensors)`` hears each
    outermost call's batch tensors, ``on_first_forward()`` the step's first outermost call."""

    def __init__(self, on_batch: Callable[[list[torch.Tensor]], None], on_first_forward: Callable[[], None],
                 thread: int) -> None:
        self.on_batch = on_batch
        self.on_first_forward = on_first_forward
        self.thread = thread
        self.depth = 0
        self.forwards = 0  # outermost calls since the last reset
        self.learning = True  # noting modules in the order they first run
        self.order: dict[int, torch.nn.Module] = {}
        self.roots: dict[int, torch.nn.Module] = {}
        self._handles: list[Any] = []

    def install(self) -> None:
        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, with_kwargs=True, always_call=True)]

    def remove(self) -> None:
        for h in self._handles:
            remove_global_forward_hook(h)
        self._handles = []
        self.order.clear()
        self.roots.clear()

    def reset(self) -> None:
        """A step ended: count the next one's calls from zero."""
        self.forwards = 0

    def stop_learning(self) -> None:
        self.learning = False
        self.order.clear()
        self.roots.clear()

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        if self.learning and id(module) not in self.order:
            self.order[id(module)] = module
        if self.depth == 0:
            if self.learning and id(module) not in self.roots:
                self.roots[id(module)] = module
            if self.forwards == 0:
                self.on_first_forward()
            self.forwards += 1
        self.depth += 1

    def _post(self, module: torch.nn.Module, args: Any, kwargs: Any, result: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            found = [t for t in flat_tensors(kwargs, flat_tensors(args)) if not t.requires_grad]
            if found:
                self.on_batch(found)
