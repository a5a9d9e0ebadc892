"""Writing ``.gtrace`` files: a whole trace at once (``write_trace``), or record by record while
recording (``StreamWriter``). JSON lines, gzip-compressed when the path ends in ``.gz``; the
format is documented in docs/trace-format.md, and ``tracer.model.fileformat`` reads it back."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import stat
import tempfile
import weakref
import zlib
from collections.abc import Iterable
from typing import IO, Any

from tracer.model.claims import OutputClaim, claim_output

GZIP_MAGIC = b"\x1f\x8b"


def _dumps(record: dict[str, Any]) -> str:
    # allow_nan: stats of tensors full of Inf are real data; JSON's NaN/Infinity extension is
    # what Python reads back, and the loader accepts nothing else beyond strict JSON.
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)


def write_trace(records: Iterable[dict[str, Any]], path: str) -> None:
    """Write a complete trace's records (``Trace.records()``, in canonical order).

    Written to a fresh temporary file in the target's directory (``mkstemp``: created with
    ``O_EXCL`` under an unpredictable name, so a link planted there is never followed) and renamed
    over the target: the file is either complete or absent."""
    path = os.fspath(path)
    folder, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as raw:
            binary: IO[bytes] = raw
            if path.endswith(".gz"):
                binary = gzip.GzipFile(filename=base, mode="wb", fileobj=raw)  # type: ignore[assignment]
            with io.TextIOWrapper(binary, encoding="utf-8") as fh:
                for rec in records:
                    fh.write(_dumps(rec))
                    fh.write("\n")
                fh.flush()
                if binary is not raw:
                    binary.close()  # the gzip trailer, before the raw file closes
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _mode_for(path: str) -> int:
    """``mkstemp`` makes the file private (0600); a saved trace gets what ``open()`` would have
    given it: the existing file's mode, or 0666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


class StreamWriter:
    """Appends records to a trace file as recording goes, flushing so a crash loses little.

    Every ``write`` reaches the operating system before it returns (a SIGKILL right after loses
    nothing of it); a gzip file gets a sync flush there (``Z_SYNC_FLUSH``), so a reader can
    decompress everything up to that point even if the file ends right after it. ``append=True``
    adds a segment after what the file holds (a multi-step file) instead of starting afresh.
    """

    def __init__(self, path: str, append: bool = False) -> None:
        self.path = str(path)
        # Claimed before it is opened (and truncated): a second process writing the same file
        # gets OutputInUse and the first one's file is untouched.
        self._claim: OutputClaim | None = claim_output(self.path)
        try:
            self._raw: IO[bytes] | None = open(self.path, "ab" if append else "wb")  # noqa: SIM115 (kept open)
            self._gz: gzip.GzipFile | None = gzip.GzipFile(filename=os.path.basename(self.path), mode="wb",
                                                           fileobj=self._raw) if self.path.endswith(".gz") else None
        except BaseException:
            self._claim.release()
            raise
        _OPEN.add(self)

    def disown(self) -> None:
        """In a process forked while this file was open (a DataLoader worker started inside a
        traced block): the file is the parent's. This process's copy of the descriptor is
        pointed at /dev/null, so nothing it writes, flushes or closes (a gzip trailer at exit)
        reaches the parent's file, and the writer writes nothing more."""
        raw, self._raw, self._gz = self._raw, None, None
        self._claim = None  # the parent's (tracer.model.claims forgets it in the child)
        if raw is None:
            return
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, raw.fileno())
            finally:
                os.close(null)
        except OSError:  # no /dev/null: the objects are kept, unflushed, and never written
            _DISOWNED.append(raw)

    def write(self, records: list[dict[str, Any]]) -> None:
        if self._raw is None or not records:
            return
        data = "".join(_dumps(r) + "\n" for r in records).encode("utf-8")
        if self._gz is not None:
            self._gz.write(data)
            self._gz.flush(zlib.Z_SYNC_FLUSH)  # complete deflate blocks, byte-aligned, in the file
        else:
            self._raw.write(data)
        self._raw.flush()

    def close(self) -> None:
        if self._raw is None:
            return
        try:
            if self._gz is not None:
                self._gz.close()  # the gzip trailer (CRC and size): the member is complete
        finally:
            self._raw.close()
            self._raw = None
            self._gz = None
            if self._claim is not None:
                self._claim.release()
                self._claim = None


# Stream writers with an open file, for the fork handler below.
_OPEN: weakref.WeakSet[StreamWriter] = weakref.WeakSet()
_DISOWNED: list[IO[bytes]] = []


def _disown_in_child() -> None:
    for w in list(_OPEN):
        w.disown()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_in_child)
