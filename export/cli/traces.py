"""What every command that reads a trace shares: ``--step N``, ``--max-decompressed SIZE``, and
loading with the file's warnings and steps said on stderr (one line each, inert text)."""

from __future__ import annotations

import argparse
import sys

from export.cli.command import size
from export.load import LoadedTrace, open_trace, print_notes
from export.text import inert
from tracer.model import StepInfo
from tracer.model.display import plural
from tracer.model.fileformat import ENV_MAX_DECOMPRESSED


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step number: {text[:40]!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("a step number is 0 or more")
    return value


def add_trace_options(p: argparse.ArgumentParser) -> None:
    """``--step N`` and ``--max-decompressed SIZE`` on a command that reads traces."""
    p.add_argument("--step", type=_step, metavar="N",
                   help="in a file of several traced steps, the step to use (default: the first; the "
                        "file's steps and their status are listed)")
    p.add_argument("--max-decompressed", type=size, metavar="SIZE",
                   help=f"refuse a gzip trace that decompresses to more than SIZE (default 4GiB, or "
                        f"${ENV_MAX_DECOMPRESSED}); a guard against gzip bombs")


NOTE_STEPS = 12  # the steps a command's note lists (one line on stderr); summary lists them all


def step_facts(info: StepInfo) -> str:
    """``step 3: failed (RuntimeError), 412 calls, NaN/Inf in 2 tensors``."""
    name = f"step {info.step}" if info.step is not None else f"trace at line {info.line}"
    status = info.status
    if info.error and info.error.get("type"):
        status += f" ({info.error['type']})"
    text = f"{name}: {status}, {plural(info.calls, 'call')}"
    if info.nonfinite:
        text += f", NaN/Inf in {plural(info.nonfinite, 'tensor')}"
    return inert(text)


def load_for(args: argparse.Namespace, path: str, *, say_steps: bool = True) -> LoadedTrace:
    """Load ``path`` as the command's options say; warnings on stderr, and for a file of several
    steps read without ``--step``, which steps it holds and which one is shown."""
    loaded = open_trace(path, getattr(args, "step", None), max_decompressed=getattr(args, "max_decompressed", None))
    print_notes(loaded.notes)
    if say_steps and loaded.several_steps and getattr(args, "step", None) is None:
        shown = loaded.steps[0]
        listed = "; ".join(step_facts(s) for s in loaded.steps[:NOTE_STEPS])
        if len(loaded.steps) > NOTE_STEPS:
            listed += f"; and {len(loaded.steps) - NOTE_STEPS} more (gradtrace summary lists them)"
        print(f"gradtrace: note: {inert(path)} holds {len(loaded.steps)} traces ({listed}); showing the "
              f"first{'' if shown.step is None else f' (step {shown.step})'}, choose one with --step N",
              file=sys.stderr)
    return loaded


__all__ = ["add_trace_options", "load_for", "step_facts"]
