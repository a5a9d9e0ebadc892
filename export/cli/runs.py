"""Running a program again under ``gradtrace run``, in a process of its own (``gradtrace bisect
--run`` and ``gradtrace run --check-determinism``): each run starts fresh, as the user's own
runs did, and its output goes to a file kept beside its step log and traces.

Progress is said on stderr: a line when a run starts and one when it ends (steps logged, time,
exit status); on a terminal a live line counts the steps the run has logged so far.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from export.errors import UserError
from tracer.model.display import format_size, plural

POLL_SECONDS = 0.25


def program_words(command: str) -> list[str]:
    """A program's command line as ``gradtrace run`` takes it: ``python train.py --lr 3`` and
    ``train.py --lr 3`` give ``train.py --lr 3``; ``python -m pkg.train`` gives ``-m pkg.train``."""
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise UserError(f"cannot split the command {command!r}: {exc}") from None
    if not words:
        raise UserError("an empty command: give the program's command line, e.g. \"python train.py --lr 3e-4\"")
    first = os.path.basename(words[0])
    if first == "gradtrace" or (first.startswith("python") and words[1:3] == ["-m", "tracer"]):
        raise UserError(f"give the program's own command line, not gradtrace's: {command!r}")
    if first.startswith("python") and all(c.isdigit() or c == "." for c in first[len("python"):]):
        words = words[1:]
        if not words:
            raise UserError(f"no script or module in {command!r}")
    return words


@dataclass
class Run:
    """One run of a program under ``gradtrace run``."""

    label: str
    words: list[str]
    log: str
    output: str  # its stdout and stderr
    code: int = 0
    seconds: float = 0.0

    def command(self, extra: Sequence[str]) -> list[str]:
        return [sys.executable, "-m", "tracer", "run", "--no-progress", "--log", self.log, *extra, *self.words]

    def failed_words(self) -> str:
        tail = last_lines(self.output, 3)
        return f"{self.label} exited with status {self.code} (its output: {self.output}" + \
            (f"; it ended with: {tail}" if tail else "") + ")"


def run_program(run: Run, extra: Sequence[str], what: str, err: TextIO) -> Run:
    """Run ``run``'s program under ``gradtrace run --log`` with the ``extra`` options; its output
    goes to ``run.output``. Says ``what`` it does on ``err``."""
    shown = shlex.join(run.words)
    print(f"gradtrace: {run.label}: {what}: {shown} (output: {run.output})", file=err, flush=True)
    start = time.monotonic()
    with open(run.output, "wb") as out:
        proc = subprocess.Popen(run.command(extra), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        live = _LiveCount(run, err) if _tty(err) else None
        try:
            while proc.poll() is None:
                time.sleep(POLL_SECONDS)
                if live is not None:
                    live.update()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            if live is not None:
                live.stop()
    run.code = proc.returncode
    run.seconds = time.monotonic() - start
    steps = logged_steps(run.log)
    status = "" if run.code == 0 else f", exit status {run.code}"
    print(f"gradtrace: {run.label}: {plural(steps, 'step')} logged in {run.seconds:.1f} s{status}", file=err, flush=True)
    return run


def logged_steps(path: str) -> int:
    """Steps a log holds so far (counted from its lines: cheap, and fine while it grows)."""
    try:
        with open(path, "rb") as fh:
            return sum(line.startswith(b'{"t":"step"') for line in fh)
    except OSError:
        return 0


def last_lines(path: str, n: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 4096))
            lines = [ln.strip() for ln in fh.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[:400]


def _tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class _LiveCount:
    """On a terminal: one line rewritten with the steps logged so far."""

    def __init__(self, run: Run, err: TextIO) -> None:
        self.run, self.err = run, err
        self.shown = ""

    def update(self) -> None:
        try:
            size = format_size(os.path.getsize(self.run.log))
        except OSError:
            size = "0 B"
        text = f"gradtrace: {self.run.label}: running, {plural(logged_steps(self.run.log), 'step')} logged ({size})"
        if text != self.shown:
            self.err.write("\r" + text.ljust(len(self.shown)))
            self.err.flush()
            self.shown = text

    def stop(self) -> None:
        if self.shown:
            self.err.write("\r" + " " * len(self.shown) + "\r")
            self.err.flush()


def prepare_dir(path: str, force: bool) -> str:
    """The folder the runs' files go to: created, or reused when empty or ``force``."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"--out {path} is a file, not a folder")
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise UserError(f"--out {path} holds files already (from an earlier run?): choose another folder, or "
                        "give --force to overwrite them")
    os.makedirs(path, exist_ok=True)
    return path
