"""``gradtrace demo``: trace one training step of the bundled tiny GPT and show what came out.

This module is the command's definition; what it does is ``export.cli.demo_step``'s, imported
(with torch) when the command runs, so that ``gradtrace --help`` starts without torch.
"""

from __future__ import annotations

import argparse

from export.cli.command import Command, deferred

DEFAULT_OUT = "demo.gtrace"


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--out", default=DEFAULT_OUT, help=f"trace file to write (default {DEFAULT_OUT})")
    p.add_argument("--no-report", action="store_true", help="do not write the HTML report")


COMMAND = Command(
    "demo", help="trace one training step of a bundled tiny GPT and summarise it",
    description="Trace one CPU training step (forward, backward, AdamW) of a tiny GPT-style "
                "model that ships with gradtrace, write the trace (and an HTML report when "
                "available) and print a summary. An existing file that is not a trace is "
                "never overwritten.",
    arguments=_arguments, run=deferred("export.cli.demo_step", "cmd_demo"))
