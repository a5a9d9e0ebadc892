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
from collections.abc import Iterable
from typing import IO, Any, cast

GZIP_MAGIC = b"\x1f\x8b"


def _open_write(path: str, gz: bool | None = None, append: bool = False) -> IO[str]:
    # Appending to a gzip file adds a gzip member; readers decompress members back to back.
    if str(path).endswith(".gz") if gz is None else gz:
        return io.TextIOWrapper(gzip.open(path, "ab" if append else "wb"), encoding="utf-8")
    return open(path, "a" if append else "w", encoding="utf-8")


def _dumps(record: dict[str, Any]) -> str:
    # allow_nan: stats of tensors full of Inf are real data; JSON's NaN/Infinity extension is
    # what Python reads back, and the loader accepts nothing else beyond strict JSON.
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)


def write_trace(records: Iterable[dict[str, Any]], path: str) -> None:
    """Write a complete trace's records (``Trace.records()``, in canonical order).

    The records go to a fresh temporary file in the target's directory (``mkstemp``: a new name,
    created with ``O_EXCL``, so a link planted at a predictable name is never followed), which is
    then renamed over ``path``: a saved file is complete or absent.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as raw:
            binary = cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="wb") if path.endswith(".gz") else raw)
            with io.TextIOWrapper(binary, encoding="utf-8") as fh:
                for rec in records:
                    fh.write(_dumps(rec))
                    fh.write("\n")
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _mode_for(path: str) -> int:
    # mkstemp makes the file private (0600); a saved trace gets what open() would have given it:
    # the existing file's mode, or 0666 less the umask.
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


class StreamWriter:
    """Appends records to a trace file as recording goes, flushing so a crash loses little.

    ``append=True`` adds a segment after what the file holds (a multi-step file) instead of
    starting the file afresh.
    """

    def __init__(self, path: str, append: bool = False) -> None:
        self.path = str(path)
        self._fh: IO[str] | None = _open_write(self.path, append=append)

    def write(self, records: list[dict[str, Any]]) -> None:
        if self._fh is None or not records:
            return
        self._fh.write("".join(_dumps(r) + "\n" for r in records))
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
