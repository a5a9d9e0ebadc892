"""``gradtrace memory TRACE``: the memory record of a ``trace(memory=True)`` trace as tables,
CSV or a plot."""

from __future__ import annotations

import argparse
import importlib.util

from rich.text import Text

from export.cli.command import Command
from export.cli.console import make_console
from export.cli.outputs import check_output
from export.cli.traces import add_trace_options, load_for
from export.errors import UserError
from export.text import inert
from tracer.analysis.memory import MemoryRecord
from tracer.analysis.memory_views import PlotUnavailable, plot_record, record_tables, write_csv


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a .gtrace file")
    p.add_argument("--top", type=_rows, default=15, help="rows per table (default 15)")
    p.add_argument("--csv", metavar="PATH", help="also write every event as CSV")
    p.add_argument("--plot", metavar="PATH", help="also plot the timeline (.png or .svg; needs matplotlib)")
    p.add_argument("--device", help="device of the plot (default: the one with the most bytes)")
    add_trace_options(p)


def _rows(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text[:40]!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def _plotting_installed() -> bool:
    """Whether matplotlib, which ``--plot`` draws with, can be imported (found, not imported)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a broken install, or a module without a spec
        return False


def _cmd_memory(args: argparse.Namespace) -> int:
    # Before anything is loaded or printed: a missing plotter is one line, not the tables and then an error.
    if args.plot is not None and not _plotting_installed():
        raise UserError("--plot needs matplotlib: pip install 'gradtrace[memory]' (or matplotlib)")
    for option, out in (("--csv", args.csv), ("--plot", args.plot)):
        if out is not None:
            check_output(out, [args.trace], option=option)
    trace = load_for(args, args.trace).trace
    rec = MemoryRecord.from_trace(trace)
    if not rec.events:
        raise UserError(f"{args.trace} has no memory records; record with tracer.trace(memory=True) "
                        "or tracer.record_memory()")
    if args.device is not None and args.device not in rec.devices():
        raise UserError(f"no memory events on {args.device!r}; devices: {', '.join(rec.devices()) or 'none'}")
    console = make_console()
    story = trace.anomalies
    if story.headline is not None:  # the step's NaN/Inf story first, in the words of every surface
        console.print(Text(inert(story.headline_text()), style="red" if story.skipped_step is None else "yellow"),
                      soft_wrap=True)
    console.print(record_tables(rec, top=args.top))
    if args.csv:
        write_csv(rec, args.csv)
        print(f"wrote {args.csv}")
    if args.plot:
        try:
            plot_record(rec, args.plot, args.device)
        except (PlotUnavailable, ValueError) as exc:
            raise UserError(str(exc)) from None
        print(f"wrote {args.plot}")
    return 0


COMMAND = Command(
    "memory", help="allocations and frees of a trace, attributed to calls and grad nodes",
    description="Print the memory record of a trace made with tracer.trace(memory=True) or "
                "tracer.record_memory(): totals per device, top allocators by bytes, per module, "
                "forward vs backward, and the tensors live at the peak.",
    arguments=_arguments, run=_cmd_memory)
