"""A fast identity map from live tensors to small values, holding only weak references.

``torch.utils.weak.WeakIdKeyDictionary`` dereferences through ``_fix_weakref`` on every
comparison, which made it the largest single cost of recording. Here the key is ``id(t)`` and
the entry keeps a plain ``weakref.ref``; a look-up checks that the reference still points at the
same object, so a recycled id never returns a stale value. The weakref's callback removes the
entry when the tensor dies, unless the id was already reused by a newer entry.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class IdWeakMap(Generic[V]):
    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref[Any], V]] = {}

    def get(self, obj: Any) -> V | None:
        entry = self._d.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def __contains__(self, obj: Any) -> bool:
        return self.get(obj) is not None

    def __setitem__(self, obj: Any, value: V) -> None:
        key = id(obj)
        d = self._d

        def drop(ref: weakref.ref[Any], key: int = key, d: dict[int, tuple[weakref.ref[Any], V]] = d) -> None:
            entry = d.get(key)
            if entry is not None and entry[0] is ref:
                del d[key]

        self._d[key] = (weakref.ref(obj, drop), value)

    def __len__(self) -> int:
        return len(self._d)

    def clear(self) -> None:
        self._d.clear()
