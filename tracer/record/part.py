"""What every part of the recorder has: a link to the ``Recorder`` it belongs to.

The recorder is a small façade over parts that own their state (docs/architecture.md, "The
recorder's parts"): tensor names, the graph, module scopes, optimizer steps, custom Functions,
swaps, the capture of calls. A part keeps its tables private; the others call its public methods
and read the shared state (the trace, the lock, the hasher, the flags) on the recorder, through
``rec``. The links back from the parts to the recorder are the only reference cycle of a
recorder: ``release`` drops them once the trace is done, so a finished trace is freed by
reference counting, not by the cycle collector walking every record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder


class Part:
    """A part of one trace's recorder."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def release(self) -> None:
        """Drop the link back to the recorder (the trace is done: nothing calls this part again).
        Safe to call twice."""
        self.__dict__.pop("rec", None)


def remove_all(handles: list[Any]) -> None:
    """Remove every hook handle of ``handles`` and empty the list; a handle whose owner is gone
    already is passed over (a trace's end must not fail on one)."""
    for h in handles:
        try:
            h.remove()
        except Exception:  # a handle whose owner is gone already
            pass
    handles.clear()
