"""Log levels: the ``gradtrace`` logger and one child per component, the levels of detail above
DEBUG (STATS, VALUES), reading a level spec, and saving/restoring levels around a scope."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

ROOT = "gradtrace"


ENV_VAR = "GRADTRACE_LOG"


STATS = 7


VALUES = 5


VALUES_MAX_NUMEL = 16
logging.addLevelName(STATS, "STATS")
logging.addLevelName(VALUES, "VALUES")


# Components with a logger of their own; another module that logs adds its name here.
COMPONENTS: list[str] = ["forward", "backward", "memory"]


_ALIASES = {"NAMES": logging.INFO, "SHAPES": logging.DEBUG, "STATS": STATS, "VALUES": VALUES}


LevelSpec = str | int | Mapping[str, str | int]


FORWARD = logging.getLogger(f"{ROOT}.forward")


BACKWARD = logging.getLogger(f"{ROOT}.backward")


# ---- levels -----------------------------------------------------------------------------------------
def parse_level(value: str | int) -> int:
    """A level given as a number, a ``logging`` name (``"DEBUG"``) or a detail name (``"shapes"``)."""
    if isinstance(value, bool):
        raise ValueError(f"not a log level: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("-").isdigit():
            return int(text)
        key = text.upper()
        if key in _ALIASES:
            return _ALIASES[key]
        known = logging.getLevelName(key)
        if isinstance(known, int):
            return known
    names = "CRITICAL, ERROR, WARNING, INFO, DEBUG, STATS, VALUES, NOTSET, names, shapes, or a number"
    raise ValueError(f"not a log level: {value!r} (use {names})")


def logger_of(component: str) -> logging.Logger:
    if component == "*":
        return logging.getLogger(ROOT)
    if component not in COMPONENTS:
        raise ValueError(f"unknown log component {component!r}; known: '*', {', '.join(map(repr, COMPONENTS))}")
    return logging.getLogger(f"{ROOT}.{component}")


def set_levels(level: LevelSpec) -> None:
    """Set gradtrace's log levels at run time.

    ``set_log_level("DEBUG")`` (or a number) sets every component: the ``gradtrace`` logger gets
    the level and each component follows it. ``set_log_level({"forward": "DEBUG", "*": "WARNING"})``
    sets the components named (``"*"`` is the ``gradtrace`` logger, which components without a
    level of their own follow) and leaves the others as they are. Levels take effect inside
    ``tracer.trace()`` blocks and ``log_scope`` blocks (nothing is recorded elsewhere).
    """
    if isinstance(level, Mapping):
        todo = [(logger_of(str(k)), parse_level(v)) for k, v in level.items()]
        for lg, lv in todo:
            lg.setLevel(lv)
    else:
        lv = parse_level(level)
        logging.getLogger(ROOT).setLevel(lv)
        for lg in _gradtrace_loggers():
            if lg.name != ROOT:
                lg.setLevel(logging.NOTSET)


def get_log_level(component: str | None = None) -> dict[str, str | int] | str | int:
    """Effective level of one component (``"forward"``, ``"*"``...) or, with no argument, of all.

    Levels come back as names where they have one (``"DEBUG"``, ``"STATS"``), else as numbers.
    """
    if component is not None:
        return _level_name(logger_of(component).getEffectiveLevel())
    return {c: _level_name(logger_of(c).getEffectiveLevel()) for c in ("*", *COMPONENTS)}


def _level_name(level: int) -> str | int:
    name = logging.getLevelName(level)
    return name if isinstance(name, str) and not name.startswith("Level ") else level


def _gradtrace_loggers() -> list[logging.Logger]:
    out = [logging.getLogger(ROOT)]
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if name.startswith(ROOT + ".") and isinstance(lg, logging.Logger):
            out.append(lg)
    return out


def _snapshot() -> dict[str, int]:
    return {lg.name: lg.level for lg in _gradtrace_loggers()}


def _restore(snap: dict[str, int]) -> None:
    for lg in _gradtrace_loggers():
        # A logger made during the scope did not exist before: it had no level of its own.
        want = snap.get(lg.name, logging.NOTSET)
        if lg.level != want:
            lg.setLevel(want)


def detail_of(level: int) -> int | None:
    """The detail a logger at ``level`` gets (the record's level), or None when it is off."""
    if level <= VALUES:
        d = VALUES
    elif level <= STATS:
        d = STATS
    elif level <= logging.DEBUG:
        d = logging.DEBUG
    elif level <= logging.INFO:
        d = logging.INFO
    else:
        return None
    return None if logging.root.manager.disable >= d else d


# Open scopes' saved levels, oldest first. Levels are process-wide while scopes can close in any
# order (threads): each entry holds the levels from before its scope; closing the newest restores
# them, closing an older one hands its saved levels to the next, so the last to close restores
# what was there before the first opened.
_LOCK = threading.RLock()


_SAVED: list[tuple[object, dict[str, int]]] = []


def push_levels(owner: object, level: LevelSpec) -> None:
    with _LOCK:
        snap = _snapshot()
        try:
            set_levels(level)
        except BaseException:
            _restore(snap)
            raise
        _SAVED.append((owner, snap))


def pop_levels(owner: object) -> None:
    with _LOCK:
        i = next((k for k, (o, _) in enumerate(_SAVED) if o is owner), None)
        if i is None:
            return
        _, snap = _SAVED.pop(i)
        if i == len(_SAVED):
            _restore(snap)
        else:
            _SAVED[i] = (_SAVED[i][0], snap)


def user_level(component: str) -> int:
    """The level the user set, not counting open scopes (they raise levels for their own block)."""
    try:
        base = _SAVED[0][1]
    except IndexError:
        return logging.getLogger(f"{ROOT}.{component}").getEffectiveLevel()
    return base.get(f"{ROOT}.{component}") or base.get(ROOT) or logging.root.getEffectiveLevel()


def parse_env(text: str) -> dict[str, str]:
    """``"forward=DEBUG,backward=INFO"`` -> ``{"forward": "DEBUG", "backward": "INFO"}``; a bare
    level (``"DEBUG"``) is ``"*"``, i.e. every component without a level of its own."""
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if sep:
            out[key.strip() or "*"] = value.strip()
        else:
            out["*"] = key
    return out
