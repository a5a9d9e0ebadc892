"""Comparing traces: ``diff(a, b)`` (the first divergence of two runs of one step, forward and
backward) and ``diff_ranks(traces)`` (which rank of a data-parallel step departed first).

``align`` pairs the records of two traces; ``engine`` compares them and finds the origin;
``result`` holds what it found (``DiffResult``); ``console`` prints results on a terminal and
``page`` writes the self-contained HTML view; ``ranks`` is the per-rank comparison.
"""

from __future__ import annotations

from export.diff.engine import Comparer, check_comparable, diff, stat_diff
from export.diff.page import diff_html, diff_html_text, diff_payload
from export.diff.ranks import Departure, RankDiffResult, diff_ranks
from export.diff.result import (
    Compared,
    DiffResult,
    Divergence,
    ModuleStat,
    ParamDiff,
    PhaseCount,
    Row,
    Tolerance,
    module_table,
)
from export.errors import DiffError

__all__ = ["Compared", "Comparer", "Departure", "DiffError", "DiffResult", "Divergence", "ModuleStat", "ParamDiff",
           "PhaseCount", "RankDiffResult", "Row", "Tolerance", "check_comparable", "diff", "diff_html", "diff_html_text",
           "diff_payload", "diff_ranks", "module_table", "stat_diff"]
