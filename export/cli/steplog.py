"""``gradtrace run --log run.gtsteps``: the step log around a program run by ``gradtrace run``
(with or without traced steps, with ``--watch`` too), and what is said about it at the end."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

import tracer
from export.cli.outputs import check_output
from tracer.loops.program import Program
from tracer.model.display import format_size, plural


def check_log(args: argparse.Namespace) -> None:
    """Refuse a ``--log`` path that cannot be written, before the program runs."""
    if args.log is not None:
        check_output(args.log, option="--log")


@contextlib.contextmanager
def logged(args: argparse.Namespace, program: Program) -> Iterator[None]:
    """Log every optimizer step of the program into ``args.log`` (nothing without ``--log``);
    when it ends, say how many steps went where."""
    if args.log is None:
        yield
        return
    log = tracer.StepLog(args.log, source="gradtrace run",
                         program={"argv": [program.target, *program.args], "module": program.is_module})
    log.start()
    try:
        yield
    finally:
        log.close()
        size = os.path.getsize(log.path) if os.path.exists(log.path) else 0
        failed = f" (it stopped early: {log.failed})" if log.failed else ""
        print(f"gradtrace: logged {plural(log.steps, 'step')} of {program.target} -> {log.path} "
              f"({format_size(size)}){failed}", file=sys.stderr)
        if not log.steps and not log.failed:
            print("gradtrace: no optimizer.step() ran, so the log holds no step", file=sys.stderr)
