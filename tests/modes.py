"""A program's own ``TorchFunctionMode`` for tests that check gradtrace's work stays invisible to
the modes a program runs under."""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode


class CountingMode(TorchFunctionMode):
    """The program's own TorchFunctionMode: counts the torch calls it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))
