"""What goes into a step besides the parameters: the batch, the random number generators, and
the order in which the model runs its modules.

``ForwardInputs`` sees every outermost module call (one made while no other module runs) on the
thread that opened the log:

- as such a call begins, it takes the digests of the random number generators if it is the
  step's first forward;
- as it ends (its forward hook sees keyword arguments, which a global pre-hook does not), it
  collects the step's batch: every tensor given to the call that nothing differentiable made
  and that is not trainable itself (token ids, labels, images, masks; not an activation handed
  from one model to another, not a parameter).

Until the log has named the parameters it *learns*: two global module hooks see every module
call, count the depth, and note each module the first time it runs (execution order) and the
outermost ones. After that only outermost calls matter, and a global hook makes PyTorch take
``Module.__call__``'s slow path for every module (about 2 µs a call, 186 calls a forward on the
Llama-style model). So the log keeps one global pre-hook while no module runs: at an outermost
call it hooks that module alone and removes itself; every module inside the call runs without
hooks; when the call ends the module's hooks go and the global pre-hook comes back. A module
that was never called before is seen the same way, whenever it first runs outermost.
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
    """The module hooks (see the module docstring); ``on_batch(tensors)`` hears each outermost
    call's batch tensors, ``on_first_forward()`` the step's first outermost call."""

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
        self._handles: list[Any] = []  # the global hooks installed now
        self._scoped: list[Any] = []  # the hooks of the outermost module running now (not learning)

    def install(self) -> None:
        if self.learning:
            self._handles = [register_module_forward_pre_hook(self._pre),
                             register_module_forward_hook(self._post, with_kwargs=True, always_call=True)]
        else:
            self._handles = [register_module_forward_pre_hook(self._outer)]

    def remove(self) -> None:
        self._remove_global()
        self._remove_scoped()
        self.depth = 0
        self.order.clear()
        self.roots.clear()

    def _remove_global(self) -> None:
        for h in self._handles:
            remove_global_forward_hook(h)
        self._handles = []

    def _remove_scoped(self) -> None:
        for h in self._scoped:
            h.remove()
        self._scoped = []

    def reset(self) -> None:
        """A step ended: count the next one's calls from zero."""
        self.forwards = 0

    def stop_learning(self) -> None:
        """The parameters are named: from now on only outermost calls are seen (the global
        hooks give way to one global pre-hook as soon as no module runs)."""
        self.learning = False
        self.order.clear()
        self.roots.clear()
        if self.depth == 0 and self._handles:
            self._remove_global()
            self.install()

    # ---- learning: every module call -----------------------------------------------------------------
    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        if self.learning and id(module) not in self.order:
            self.order[id(module)] = module
        if self.depth == 0:
            if self.learning and id(module) not in self.roots:
                self.roots[id(module)] = module
            self._began()
        self.depth += 1

    def _post(self, module: torch.nn.Module, args: Any, kwargs: Any, result: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self._ended(args, kwargs)
            if not self.learning and self._handles:  # learning ended inside a call: now it is over
                self._remove_global()
                self.install()

    # ---- learned: outermost calls only -------------------------------------------------------------
    def _outer(self, module: torch.nn.Module, args: Any) -> None:
        """A module call while none runs (the global pre-hook): hook this module for its call."""
        if threading.get_ident() != self.thread:
            return
        self._began()
        self.depth = 1
        self._remove_global()
        # Registered inside the module's own call: PyTorch reads its forward hooks after the
        # forward, so ``_inner_post`` ends this call; ``_inner_pre`` counts calls of the same
        # module inside it (its pre-hooks of this call were read before this one ran).
        self._scoped = [module.register_forward_pre_hook(self._inner_pre),
                        module.register_forward_hook(self._inner_post, with_kwargs=True, always_call=True)]

    def _inner_pre(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == self.thread:
            self.depth += 1

    def _inner_post(self, module: torch.nn.Module, args: Any, kwargs: Any, result: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        self.depth -= 1
        if self.depth == 0:
            self._remove_scoped()
            self.install()
            self._ended(args, kwargs)

    # ---- an outermost call ----------------------------------------------------------------------------
    def _began(self) -> None:
        if self.forwards == 0:
            self.on_first_forward()
        self.forwards += 1

    def _ended(self, args: Any, kwargs: Any) -> None:
        found = [t for t in flat_tensors(kwargs, flat_tensors(args)) if not t.requires_grad]
        if found:
            self.on_batch(found)
