"""Identity keys for the hot path, without ``id()``.

From Python 3.8 every ``id()`` call raises the audit event ``builtins.id``, and every read of a
frame's ``f_code`` raises ``object.__getattr__``. They cost nothing until some library installs
an audit hook. From then on each one is a call into Python. filelock 4 does this on Python 3.12
and later, and transformers, huggingface_hub and datasets import filelock.

With that hook installed (Python 3.12), ``id()`` takes about 220 ns here and ``object.__hash__``
about 55 ns. A traced GPT-2 step makes some 20,000 identity look-ups.

``object.__hash__`` is the object's address, rotated: unique among live objects, like ``id()``.
It is called through ``object``, so a class that defines its own ``__hash__`` (``Tensor`` does,
in Python) does not get in the way.
"""

from __future__ import annotations

from collections.abc import Callable

identity: Callable[[object], int] = object.__hash__
