"""Recording a step on a stack that does not depend on the test runner.

A recorded call keeps every frame of the process's stack, down to the runner's own: pytest's
``__main__`` when run as ``python -m pytest``, and under pytest-xdist the worker's bootstrap,
code that execnet runs with ``exec`` from strings (file ``"<string>"``), which gradtrace, like
Python, counts as the user's. Tests that check which of a stack's frames are the user's record
their step here, in a thread of its own: below the step lie only threading's and
``concurrent.futures``' frames (the standard library), whatever runs the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def on_a_fresh_stack(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` run in a new thread; its result, or its exception raised here."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()
