"""The live progress line that ``thundersync run`` draws on stderr while a graph runs.

One line, redrawn in place every ``interval_s`` from the runtime's statistics: the events each
stage has processed so far (the events it sent, for a source)::

    [   1.2s] source 40  generate 40  reward 580  close 1200  step 9

Stage names come from the pipeline file, so they are printed escaped
(:func:`~thundersync.app._terminal.printable`). The final counts stay on screen.
"""

from __future__ import annotations

from typing import TextIO

import anyio

from thundersync.app._terminal import printable
from thundersync.pipeline import Pipeline
from thundersync.pipeline.runner import RunStatistics

__all__ = ["progress_line", "show_final", "show_progress"]

_REDRAW = "\r\x1b[K"  # back to the line's start, then clear it


def progress_line(stats: RunStatistics) -> str:
    """``[   1.2s] source 40  generate 40  ...``: events processed per stage (sent, for a source)."""
    parts = [f"{printable(name)} {s.received or s.sent}" for name, s in stats.stages.items()]
    return f"[{stats.elapsed_s:7.1f}s] " + "  ".join(parts)


async def show_progress(pipeline: Pipeline, stream: TextIO, interval_s: float) -> None:
    """Redraw the line on ``stream`` every ``interval_s`` until cancelled."""
    while True:
        stream.write(_REDRAW + progress_line(pipeline.statistics()))
        stream.flush()
        await anyio.sleep(interval_s)


def show_final(stream: TextIO, stats: RunStatistics | None) -> None:
    """Draw the last counts (nothing if the run never started) and end the line."""
    stream.write(_REDRAW + (progress_line(stats) if stats is not None else "") + "\n")
    stream.flush()
