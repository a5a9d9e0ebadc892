"""One writer per trace file: a process that streams a trace file claims it first.

Two programs launched side by side with the same output (two learning rates in one directory)
would otherwise both write ``run.gtrace`` at once and leave a file no command can read. A claim
is an advisory lock (``flock``) on a lock file beside the output, ``run.gtrace.lock``, which holds
the claimant's pid and host for the message the second writer gets. The kernel drops the lock
when its process ends, however it ends, so a lock file left behind by a crash (SIGKILL) claims
nothing: the next writer takes it over. A released claim removes its lock file.

Within one process claims are counted, not exclusive (``gradtrace run`` claims its output before
the program starts; the trace sessions inside it claim the same file again). Where no lock file
can be made (a directory the process may not create files in, a file system without locks, a
platform without ``fcntl``) the output is written unclaimed, as before: a lock is a protection,
never a new reason for a trace to fail.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; outputs are written unclaimed
    fcntl: Any = None  # type: ignore[no-redef]

LOCK_SUFFIX = ".lock"


class OutputInUse(OSError):
    """Another process is writing this trace file (it holds the file's claim). An ``OSError``
    (``errno.EBUSY``), raised before anything is written or installed."""


@dataclass
class _Lock:
    file: str  # the lock file
    fd: int | None  # None: unclaimed (no lock could be made here), counted all the same
    pid: int  # the process that took it: a forked child never removes its parent's lock file
    count: int = 1


_LOCKS: dict[str, _Lock] = {}
_GUARD = threading.Lock()


def lock_file(path: str) -> str:
    """Where the claim of ``path`` lives: beside the file its name resolves to."""
    return os.path.realpath(path) + LOCK_SUFFIX


class OutputClaim:
    """A held claim on one output file; ``release()`` (or leaving a ``with``) gives it back."""

    def __init__(self, path: str, key: str) -> None:
        self.path = path
        self._key: str | None = key

    @property
    def locked(self) -> bool:
        """Whether a lock backs the claim (False where none could be made)."""
        with _GUARD:
            lock = _LOCKS.get(self._key) if self._key is not None else None
            return lock is not None and lock.fd is not None

    def release(self) -> None:
        """Give the claim back; the last one of the process removes the lock file. Safe twice."""
        key, self._key = self._key, None
        if key is None:
            return
        with _GUARD:
            lock = _LOCKS.get(key)
            if lock is None:
                return
            lock.count -= 1
            if lock.count > 0:
                return
            del _LOCKS[key]
        _unlock(lock)

    def __enter__(self) -> OutputClaim:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        self.release()
        return False


def claim_output(path: str) -> OutputClaim:
    """Claim ``path`` for this process, or raise ``OutputInUse`` naming the process that holds it.

    A missing directory raises the ``FileNotFoundError`` that opening the output would."""
    key = lock_file(path)
    with _GUARD:
        lock = _LOCKS.get(key)
        if lock is not None:
            lock.count += 1
        else:
            _LOCKS[key] = _Lock(key, _lock(path, key), os.getpid())
    return OutputClaim(path, key)


def _lock(path: str, file: str) -> int | None:
    """The descriptor of ``file``, locked, holding who locked it; None where no lock can be made,
    or where the output is no regular file (``/dev/null``, a pipe: nothing there to protect)."""
    if fcntl is None or (os.path.exists(path) and not os.path.isfile(path)):
        return None
    # The previous holder removes the lock file when it lets go: a descriptor locked after that
    # is on a file no longer under that name, and the lock on the name's file is tried again.
    for _ in range(16):
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
        except OSError:  # no permission to create files there, a read-only file system, ...
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputInUse(errno.EBUSY, f"being written by another process ({holder}); choose another "
                                           "output name, or wait for that process to end", path) from None
        except OSError:  # a file system without locks
            os.close(fd)
            return None
        if _names(fd, file):
            _say_holder(fd)
            return fd
        os.close(fd)
    return None


def _names(fd: int, file: str) -> bool:
    """Whether ``file`` still names the file open as ``fd``."""
    try:
        mine, named = os.fstat(fd), os.stat(file)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)


def _say_holder(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    except OSError:  # who holds it is only for the message
        pass


def _holder(fd: int) -> str:
    try:
        said = os.read(fd, 512).decode("utf-8", "replace").strip()
    except OSError:
        said = ""
    # The file is ours to read, but another process wrote it: printable characters only.
    said = "".join(ch for ch in said if ch.isprintable())[:200]
    return said or "a process that holds its lock"


def _unlock(lock: _Lock) -> None:
    if lock.fd is None:
        return
    try:
        if lock.pid == os.getpid():  # (a forked child's copy of the descriptor: the parent's lock)
            try:
                os.unlink(lock.file)
            except OSError:
                pass
    finally:
        os.close(lock.fd)


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) holds no claim: its copies of the descriptors are
    closed (the parent's locks stay: they belong to the parent's descriptors too) and its
    writers, disowned, release nothing."""
    global _GUARD
    _GUARD = threading.Lock()  # (another thread of the parent may have held it at the fork)
    for lock in _LOCKS.values():
        if lock.fd is not None:
            try:
                os.close(lock.fd)
            except OSError:
                pass
    _LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


__all__ = ["LOCK_SUFFIX", "OutputClaim", "OutputInUse", "claim_output", "lock_file"]
