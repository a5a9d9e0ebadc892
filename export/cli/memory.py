"""``gradtrace memory TRACE``: the memory record of a ``trace(memory=True)`` trace as tables,
CSV or a plot."""

from __future__ import annotations

import argparse

from export.cli.command import Command
from export.cli.console import make_console
from export.errors import UserError
from export.load import load_trace
from tracer.analysis.memory import MemoryRecord
from tracer.analysis.memory_views import PlotUnavailable, plot_record, record_tables, write_csv


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a .gtrace file")
    p.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    p.add_argument("--csv", metavar="PATH", help="also write every event as CSV")
    p.add_argument("--plot", metavar="PATH", help="also plot the timeline (.png or .svg; needs matplotlib)")
    p.add_argument("--device", help="device of the plot (default: the one with the most bytes)")


def _cmd_memory(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    rec = MemoryRecord.from_trace(trace)
    if not rec.events:
        raise UserError(f"{args.trace} has no memory records; record with tracer.trace(memory=True) "
                        "or tracer.record_memory()")
    if args.device is not None and args.device not in rec.devices():
        raise UserError(f"no memory events on {args.device!r}; devices: {', '.join(rec.devices()) or 'none'}")
    make_console().print(record_tables(rec, top=args.top))
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
