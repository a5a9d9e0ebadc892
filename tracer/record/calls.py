"""A call in progress: what the recorder knows of a call before it has run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

CAPTURE_NOW = -1  # a stack id meaning: capture the stack when the call is finished


@dataclass(slots=True)
class PendingCall:
    """A call in progress: its inputs named and its place in the trace taken before it runs
    (``Recorder.begin_call``), finished by ``finish_call`` or ``fail_call``."""

    api: str
    short: str
    kind: str
    ins: list[torch.Tensor]
    in_names: list[str]
    seq: int
    seq0: int | None  # autograd's sequence number before the call (its grad nodes come after)
    tokens: list[Any] | None  # what each listener's before_call returned
    name: str | None = None  # taken early (a custom Function: its inner calls name it as parent)
    stack_id: int | None = CAPTURE_NOW  # taken early (a step's: where it was called)
