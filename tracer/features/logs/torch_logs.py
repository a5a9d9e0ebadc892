"""``log_scope(torch_logs=...)``: PyTorch's own logs (``torch._logging.set_logs``) for the length of
a scope, restored exactly on exit."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

try:  # private: PyTorch's log registry
    from torch._logging import _internal as _torch_logging
except ImportError:  # pragma: no cover - very old or very new torch
    _torch_logging = None  # type: ignore[assignment]

from tracer.features.logs.levels import parse_level


# ---- PyTorch's own logs, scoped ------------------------------------------------------------------------
class TorchLogs:
    """``torch._logging`` settings for the duration of a block, put back exactly afterwards."""

    def __init__(self, spec: str | Mapping[str, Any]) -> None:
        if not isinstance(spec, str | Mapping):
            raise TypeError(f"torch_logs must be a TORCH_LOGS string or a dict for torch._logging.set_logs, "
                            f"got {type(spec).__name__}")
        self.spec = spec
        self.saved: tuple[Any, dict[str, tuple[int, bool, list[logging.Handler]]]] | None = None

    @staticmethod
    def _internal() -> Any:
        if _torch_logging is None:
            raise RuntimeError("this torch has no torch._logging; torch_logs= is not available")
        return _torch_logging

    @staticmethod
    def _names(internal: Any) -> set[str]:
        reg = internal.log_registry
        return {"torch", *reg.get_log_qnames(), *reg.get_artifact_log_qnames(), *reg.get_child_log_qnames()}

    def enter(self) -> None:
        internal = self._internal()
        if "TORCH_LOGS" in os.environ:  # torch ignores set_logs then; so do we, and say so
            warnings.warn("TORCH_LOGS is set in the environment; log_scope(torch_logs=...) is ignored",
                          RuntimeWarning, stacklevel=3)
            return
        state = internal._get_log_state()
        saved_state = type(state)(dict(state.log_qname_to_level), set(state.artifact_names))
        loggers = {n: (lg.level, lg.propagate, list(lg.handlers))
                   for n in self._names(internal) for lg in [logging.getLogger(n)]}
        self.saved = (saved_state, loggers)
        try:
            if isinstance(self.spec, str):
                internal._set_log_state(internal._parse_log_settings(self.spec))
                internal._init_logs()
            else:
                set_logs: Any = getattr(torch._logging, "set_logs")  # noqa: B009  (a keyword per component and artifact)
                set_logs(**{k: v if isinstance(v, bool) or k == "modules" else parse_level(v)
                            for k, v in self.spec.items()})
        except BaseException:
            self.exit()
            raise

    def exit(self) -> None:
        if self.saved is None:
            return
        internal = self._internal()
        state, loggers = self.saved
        self.saved = None
        internal._set_log_state(state)
        internal._init_logs()
        # _init_logs rebuilds handlers and levels from the state; put back what was there exactly
        # (a level set by hand, the very handler objects) and undo loggers the block registered.
        for name in self._names(internal):
            lg = logging.getLogger(name)
            if name in loggers:
                level, propagate, handlers = loggers[name]
                lg.setLevel(level)
                lg.propagate = propagate
                lg.handlers[:] = handlers
            else:
                internal._clear_handlers(lg)
                lg.setLevel(logging.NOTSET)
                lg.propagate = True
