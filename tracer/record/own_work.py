"""gradtrace's own tensor work is not the program's.

The recorder reads what the program makes: version counters, shapes, grad functions, and the
values themselves (checksums, fingerprints, stats, copies). Torch sees those reads as torch calls,
and hands them to whatever handles torch calls at that moment:

- a ``TorchFunctionMode`` of the program's own, entered before the trace: the recording mode
  pops itself while it handles a call (torch does that for every mode), so the modes below it
  see every torch call its handler makes. A counting mode counted twice the program's calls
  (four times under ``hash="fast"``), and a mode that changes calls could change ours;
- ``torch.set_default_device`` and ``with torch.device(...)``, which are such a mode too: under
  ``"meta"``, the fingerprint's work buffers were made on the meta device and every fingerprint
  of the process was lost;
- a Python dispatch mode (``tracer.record.dispatch_modes``).

So every entry point of gradtrace's own tensor work runs with torch-function handling off
(``torch._C.DisableTorchFunction``: no mode, no subclass handler, hence no default device) and no
Python dispatch mode: ``own_work`` for a function (the hasher's entry points), ``OWN_WORK()`` for
a block (the recorder's bracket around a call: before the program's op and after it, never
around it; the op itself runs as the program called it). Entering costs ~0.2 µs. Tensors the
checksum code makes for itself are also made on an explicit device, so a buffer cached for the
process never depends on the device that was the default when it was made.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tracer.record.dispatch_modes import dispatch_modes_active, dispatch_modes_off

# The context: torch-function modes (the program's, the default device's) and subclass handlers
# off until it exits, then as they were (it nests).
OWN_WORK = torch._C.DisableTorchFunction
# Where gradtrace makes host tensors of its own (work buffers, constants, staging copies).
HOST = torch.device("cpu")

F = TypeVar("F", bound=Callable[..., Any])


# Whether torch-function handling is off altogether (inside ``OWN_WORK``); private, so where a
# torch lacks it the context is always entered (it nests).
_all_disabled: Callable[[], bool] = getattr(torch._C, "_is_torch_function_all_disabled", None) or (lambda: False)


def own_work(fn: F) -> F:
    """``fn`` run as gradtrace's own work: no torch-function mode or subclass handler sees its
    torch calls, nor any Python dispatch mode (popped while it runs, when there is one)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _all_disabled() and not dispatch_modes_active():
            # Called from gradtrace's own work already (the recorder's bracket around a call,
            # its grad-node hooks): the hasher's entry points run there for every value a step
            # makes, and entering the context again cost more than the check.
            return fn(*args, **kwargs)
        with OWN_WORK():
            if dispatch_modes_active():
                with dispatch_modes_off():
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]
