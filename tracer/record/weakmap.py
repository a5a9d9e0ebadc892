"""A fast identity map from live tensors to small values, holding only weak references.

``torch.utils.weak.WeakIdKeyDictionary`` dereferences through ``_fix_weakref`` on every
comparison, which made it the largest single cost of recording. Here the key is the object's
identity (``tracer.record.identity``: ``id()`` without its audit event) and
the entry is a weak reference that carries its value in a slot; a look-up checks that the
reference still points at the same object, so a recycled id never returns a stale value.

Entries of dead objects are swept out in bulk once the map has doubled since the last sweep
(amortised O(1) per insert), not by a callback per entry: a traced step makes thousands of
entries, and a callback would cost a Python call per dying tensor and tie every entry into a
reference cycle (entry -> callback -> dict -> entry) that only the garbage collector can free.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

from tracer.record.identity import identity

V = TypeVar("V")

_SWEEP_MIN = 1024


class _Entry(weakref.ref):  # type: ignore[type-arg]
    __slots__ = ("value",)

    value: Any


class IdWeakMap(Generic[V]):
    __slots__ = ("_d", "_sweep_at")

    def __init__(self) -> None:
        self._d: dict[int, _Entry] = {}
        self._sweep_at = _SWEEP_MIN

    def get(self, obj: Any) -> V | None:
        entry = self._d.get(identity(obj))
        if entry is None or entry() is not obj:
            return None
        value: V = entry.value
        return value

    def pop(self, obj: Any) -> V | None:
        """Take ``obj``'s entry out (its weak reference with it); its value, or None."""
        key = identity(obj)
        entry = self._d.get(key)
        if entry is None or entry() is not obj:
            return None
        del self._d[key]
        value: V = entry.value
        return value

    def __contains__(self, obj: Any) -> bool:
        return self.get(obj) is not None

    def __setitem__(self, obj: Any, value: V) -> None:
        entry = _Entry(obj)
        entry.value = value
        d = self._d
        d[identity(obj)] = entry
        if len(d) >= self._sweep_at:
            self._sweep()

    def _sweep(self) -> None:
        d = self._d
        # A snapshot (one C call, so atomic under the GIL): another thread may insert meanwhile.
        for key, entry in list(d.items()):
            if entry() is None and d.get(key) is entry:
                del d[key]
        self._sweep_at = max(_SWEEP_MIN, 2 * len(d))

    def __len__(self) -> int:
        """The number of live entries."""
        self._sweep()
        return len(self._d)

    def clear(self) -> None:
        self._d.clear()
        self._sweep_at = _SWEEP_MIN
