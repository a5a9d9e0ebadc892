"""Module scopes (a part of the recorder): global forward hooks give every call its module path
(and a stack scope), parameters and buffers are named by module path, and a ``torch.compile``
region is one opaque call. ``ModuleScopes`` owns the module paths, the stack of modules running
now and the compiled regions open."""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as nn_module

from tracer.record.calls import PendingCall
from tracer.record.mode import on_traced_thread
from tracer.record.module_roots import Caller, caller, compiled_model, enclosing_module, name_in_caller
from tracer.record.opaque import COMPILED_NOTE, ModeOff, OpaqueRegion
from tracer.record.part import Part
from tracer.record.tensors import (
    flat_tensors,
    unique,
)

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder

# Modules whose forward has an inference fast path (eval mode, gradients off) that PyTorch takes
# only when no torch function mode is active (``torch.overrides.has_torch_function``).
_FAST_PATH_MODULES = frozenset({torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                                torch.nn.TransformerEncoder})
SLOW_PATH_NOTE = ("nn.{cls} ran in eval mode with gradients off, where PyTorch takes the fused inference "
                  "path of nn.MultiheadAttention and the Transformer encoder only when no torch function mode "
                  "is active: under the trace they ran their regular path, "
                  "so their outputs can differ from an untraced run's in the last bits, and at padded positions "
                  "of a key padding mask (which the fused path leaves at zero)")


def _holds_tensors(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a module inside it has a parameter or a buffer."""
    return any(m._parameters or m._buffers for m in module.modules())


class FloatingPath(str):
    """The path kept for a module no root holds (``<Cls>``): the path it gets is that of the
    module calling it, each time (``<parent>.<Cls>``; ``ModuleScopes._floating_path``). One such
    object called from several places (transformers 5 makes its rotary helpers global
    ``nn.Module`` objects, called from every layer) is in each caller's path, not in the first
    one's. A ``str``, so that the module hooks' one look-up tells it apart by its type."""

    cls: str

    def __new__(cls, text: str, module_class: str) -> FloatingPath:
        path = super().__new__(cls, text)
        path.cls = module_class
        return path


class ModuleScopes(Part):
    """Module scopes and compiled regions (a part of ``Recorder``)."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(rec)
        self._paths: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._stack: list[str] = []  # paths of the modules running now, innermost last
        self._scope_frames: list[FrameType | None] = []  # per _stack entry, see _module_pre
        self._handles: list[Any] = []
        self._opaque: list[OpaqueRegion] = []  # compiled regions running now, innermost last
        self._slow_path_noted = False  # SLOW_PATH_NOTE is in the trace

    # ---- what the other parts ask ------------------------------------------------------------
    def innermost(self) -> str | None:
        """The path of the innermost module running now (None: none runs; ``""`` is the root)."""
        return self._stack[-1] if self._stack else None

    def path_of(self, module: torch.nn.Module) -> str | None:
        """The path the trace named ``module`` by (None: not seen)."""
        return self._paths.get(module)

    def module_at(self, path: str) -> torch.nn.Module | None:
        """The module named ``path``, if it is alive."""
        return next((m for m, p in self._paths.items() if p == path), None)

    def modules(self) -> list[torch.nn.Module]:
        """Every module the trace has named."""
        return list(self._paths.keys())

    def close_all(self) -> None:
        """The trace ends: regions still open (the block left from inside compiled code) put the
        mode back, and no frame stays held."""
        while self._opaque:
            self.close_region(self._opaque[-1])

    def let_go_of_frames(self) -> None:
        self._scope_frames.clear()

    def install_hooks(self) -> None:
        try:
            post = nn_module.register_module_forward_hook(self._module_post, always_call=True)
        except TypeError:  # older torch without always_call
            post = nn_module.register_module_forward_hook(self._module_post)
        self._handles = [nn_module.register_module_forward_pre_hook(self._module_pre), post]

    def backward_hooks(self) -> bool:
        """Whether a module backward hook is registered: on any module the trace has seen, or
        for every module."""
        if any(getattr(nn_module, name, None) for name in ("_global_backward_hooks", "_global_backward_pre_hooks")):
            return True
        return any(getattr(m, "_backward_hooks", None) or getattr(m, "_backward_pre_hooks", None)
                   for m in list(self._paths.keys()))

    def holds_every_global_module_hook(self) -> bool:
        """Whether the module hooks of the whole process are this recorder's and no one else's
        (torch warns about global hooks when a compiled module is called: then it warns about
        ours only)."""
        ours = {(id(ref()), h.id) for h in self._handles if (ref := getattr(h, "hooks_dict_ref", None))}
        if len(ours) != len(self._handles):
            return False
        for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks"):
            hooks = getattr(nn_module, name, None)
            if not isinstance(hooks, dict):
                return False
            if any((id(hooks), key) not in ours for key in hooks):
                return False
        return True

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- modules ------------------------------------------------------------------------------
    # In backward, a module runs again when activation checkpointing recomputes its forward
    # (torch.utils.checkpoint, both ways; HF gradient checkpointing): its calls carry its path,
    # as in the forward. But a module is never *named* there: a backward's frames (autograd's,
    # a hook's) say nothing of what holds it, and the first module met with the module stack
    # empty would take a root's name (the model's unprefixed one, if still free). A module first
    # met in backward (one a hook calls) is passed by, and the calls in it carry the module of
    # the grad node running, as other backward-phase calls do.
    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        rec = self.rec
        if rec.closed or (threading.get_ident() != rec.owner and not self._recomputes_here()):
            return
        path = self._paths.get(module)
        if path is None:
            if rec.in_backward:
                return
            try:
                path = self._register_module(module, caller(1) if not self._stack else None)
            except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
                rec.recorder_failed(exc)
                path = f"<{type(module).__name__}>"
        if type(path) is FloatingPath:
            path = self._floating_path(path.cls, self._stack[-1] if self._stack else "")
        if type(module) in _FAST_PATH_MODULES and not module.training:
            self._note_slow_path(module)
        self._stack.append(path)
        # The frame that called this hook runs the module's forward and stays on the stack until
        # the post-hook: stack captures inside the module stop walking there.
        self._scope_frames.append(rec.stack_table.open_scope(sys._getframe(1)))
        if compiled_model(module) is not None and not rec.paused:
            self._enter_opaque(module, args)

    def _floating_path(self, cls: str, parent: str) -> str:
        """The path of a module no root holds, of class ``cls``, called from the module at
        ``parent`` (``""``: none), registered in the trace."""
        path = f"{parent}.<{cls}>" if parent else f"<{cls}>"
        modules = self.rec.trace.modules
        if path not in modules:
            modules[path] = cls
        return path

    def _note_slow_path(self, module: torch.nn.Module) -> None:
        """An nn attention or Transformer encoder module in eval mode (with gradients off, PyTorch
        would take its fused inference path, which it skips whenever a torch function mode is
        active, as the trace's is): the trace says so, once."""
        if self._slow_path_noted or (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):
            return
        self._slow_path_noted = True  # (an encoder's layers and attention too: one note)
        self.rec.trace.notes.append(SLOW_PATH_NOTE.format(cls=type(module).__name__))

    def _recomputes_here(self) -> bool:
        """Whether this thread, not the tracing one, is an autograd engine thread running a
        traced backward (where checkpointing recomputes a forward on a device of its own):
        its module calls are the trace's too."""
        return self.rec.in_backward and on_traced_thread(self.rec)

    def _pop_modules(self, start: int) -> None:
        """Leave the module calls from ``start`` on (module stack and stack-capture scopes)."""
        del self._stack[start:]
        frames = self._scope_frames
        if len(frames) > start:
            for f in frames[start:]:
                self.rec.stack_table.close_scope(f)
            del frames[start:]

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        rec = self.rec
        if rec.closed or (threading.get_ident() != rec.owner and not self._recomputes_here()):
            return
        path = self._paths.get(module)
        stack = self._stack
        if type(path) is FloatingPath:  # (named under its caller: see _module_pre)
            path = self._floating_path(path.cls, stack[-2] if len(stack) > 1 else "")
        if stack and stack[-1] == path:
            self._pop_modules(len(stack) - 1)
        elif path in stack:
            self._pop_modules(len(stack) - 1 - stack[::-1].index(path))

    def register_root_module(self, module: torch.nn.Module, held_as: str | None = None) -> None:
        """Name modules, parameters and buffers from ``module`` down, as if it were called first
        (a trainer's model, whose forward may never be called itself). ``held_as``: the name the
        user's code holds it by, the prefix of a second root."""
        if module not in self._paths:
            self._register_root(module, None, held_as)

    def _register_module(self, module: torch.nn.Module, called_by: Caller | None = None) -> str:
        """Name ``module`` (and, for a root, its tree). ``called_by``: what the user's frame that
        called a root module holds, which may say what holds it and what it is called
        (module_roots)."""
        cls = type(module).__name__
        if self._stack:  # a module not reachable from any root seen so far
            self._paths[module] = FloatingPath(f"<{cls}>", cls)
            return self._floating_path(cls, self._stack[-1])
        if called_by is not None:
            # A part of a model called from one of the model's methods (training_step, encode):
            # the model is the root, and the part keeps its path in it.
            owner = enclosing_module(called_by, module)
            if owner is not None and owner not in self._paths:
                self._register_root(owner, None)
                held = self._paths.get(module)
                if held is not None:
                    return held
        return self._register_root(module, called_by)

    def _register_root(self, module: torch.nn.Module, called_by: Caller | None, held_as: str | None = None) -> str:
        """Name a root module's tree: from ``""`` for the first root (``named_parameters()``'s
        names), else under the name its caller holds it by (``held_as`` when known already),
        else under its class."""
        cls = type(module).__name__
        modules = self.rec.trace.modules
        prefix = ""
        # The unprefixed names are the model's: the first root that holds parameters or buffers
        # (a transform or a loss module called before it holds none, and is named as a second root).
        if "" in modules or not _holds_tensors(module):
            if held_as is None and called_by is not None:
                held_as = name_in_caller(called_by, module)
            prefix = held_as if held_as is not None and held_as not in modules else cls
        k = 1
        while prefix in modules and prefix:
            prefix = f"{cls}#{k}"
            k += 1
        # One walk over the modules names them, their parameters and their buffers, in the order
        # (and with the first-wins naming of shared ones) of named_parameters()/named_buffers();
        # three separate walks cost ~2 ms per trace on a GPT-2-sized model.
        params: list[tuple[str, torch.Tensor]] = []
        buffers: list[tuple[str, torch.Tensor]] = []
        walked = module
        compiled = compiled_model(module)
        if compiled is not None:
            # torch.compile's wrapper and the model it compiles are one model to the program: its
            # names are the model's (``0.weight``, not ``_orig_mod.0.weight``), as an eager run's
            # are, so that two runs, compiled and not, compare name by name.
            self._paths.setdefault(module, prefix)
            walked = compiled
        for sub_path, sub in walked.named_modules():
            full = f"{prefix}.{sub_path}" if prefix and sub_path else prefix or sub_path
            if sub not in self._paths:
                self._paths[sub] = full
                modules[full] = type(sub).__name__
            dot = f"{full}." if full else ""
            params += [(dot + k, v) for k, v in sub._parameters.items() if v is not None]
            buffers += [(dot + k, v) for k, v in sub._buffers.items() if v is not None]
        self.rec.names.name_by_paths(params, buffers)
        return self._paths[module]

    # ---- compiled regions ----------------------------------------------------------------------
    def open_region(self, owner: object, ins: list[torch.Tensor], hook: Any = None) -> OpaqueRegion:
        """Begin a compiled region's call, then get the recorder out of its way until
        ``close_region``: the mode off the stack (a mode inside makes Dynamo graph-break and
        recompile), our global module hooks removed (Dynamo would inline them into the compiled
        frame) and recording paused."""
        rec = self.rec
        pending = rec.begin_call(ins, api="torch.compile", short="compiled", kind="compiled")
        pending.stack_id = rec.stack_table.capture(2)
        if not self._opaque:
            self.remove_hooks()
        region = OpaqueRegion(owner, ModeOff(rec.mode), hook, pending)
        self._opaque.append(region)
        rec.paused = True
        if COMPILED_NOTE not in rec.trace.notes:
            rec.trace.notes.append(COMPILED_NOTE)
        return region

    def close_region(self, region: OpaqueRegion) -> PendingCall:
        """End ``region`` (the innermost one open): everything ``open_region`` took away is put
        back. Returns its call, for the caller to finish or fail."""
        if self._opaque and self._opaque[-1] is region:
            self._opaque.pop()
        elif region in self._opaque:
            self._opaque.remove(region)
        region.mode_off.restore()
        if region.hook is not None:
            region.hook.remove()
        self.rec.paused = bool(self._opaque)
        if not self._opaque and not self.rec.closed:
            self.install_hooks()
        return region.pending

    def _enter_opaque(self, module: torch.nn.Module, args: Any) -> None:
        # A compiled module's region ends at a one-shot hook on the compiled module itself.
        with torch._C.DisableTorchFunction():
            ins = unique(flat_tensors(args))
        try:
            hook = module.register_forward_hook(self._opaque_post, always_call=True)
        except TypeError:
            hook = module.register_forward_hook(self._opaque_post)
        self.open_region(module, ins, hook)

    def _opaque_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._opaque or self._opaque[-1].owner is not module:
            return
        pending = self.close_region(self._opaque[-1])
        with torch._C.DisableTorchFunction():
            outs = unique(flat_tensors(output))
        self.rec.finish_call(pending, outs)
        if self._stack:
            self._pop_modules(len(self._stack) - 1)
