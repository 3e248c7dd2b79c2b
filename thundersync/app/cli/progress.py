"""What ``thundersync run`` shows on stderr: a live progress line, and one summary line at the end.

The live line (on a terminal, or with ``--progress``) is redrawn in place every ``interval_s``
from the per-step records (:mod:`thundersync.app.metrics.step_metrics`)::

    step 3/10  reward 0.412 ± 0.118  812 tok/s  elapsed 0:00:12  ETA 0:00:28

``reward`` is the last step's batch mean ± standard deviation, ``tok/s`` the last step's
generated tokens over its duration, ``ETA`` the mean step time so far times the steps left
(shown once a step is done and the number of steps is known). The summary line ends a
successful run whether or not stderr is a terminal (a failed run ends with its error line)::

    thundersync: 10/10 steps in 0:00:41, last reward 0.620; metrics: runs/a/metrics.jsonl; checkpoints: runs/a

In a data-parallel launch every rank ends with its line; rank 0 alone writes files (and shows the
live line), the others say so::

    thundersync: rank 1 of 2: 10/10 steps in 0:00:41; no files (rank 0 writes the metrics and checkpoints)

Paths come from the user and are printed escaped (:func:`~thundersync.app.cli._terminal.printable`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from time import perf_counter
from typing import Any, TextIO

import anyio

from thundersync.app.cli._terminal import printable

__all__ = ["Progress", "duration", "show_progress"]

_REDRAW = "\r\x1b[K"  # back to the line's start, then clear it


def duration(seconds: float) -> str:
    """``H:MM:SS`` (whole seconds)."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    """The state behind the progress and summary lines: steps done of ``total`` (None: unknown)."""

    def __init__(self, total: int | None, *, clock: Callable[[], float] = perf_counter) -> None:
        self.total = total
        self._clock = clock
        self.started = clock()
        self.steps = 0
        self.last: Mapping[str, Any] | None = None
        self._first_step = 0  # the step count this run started from (a resumed run's is > 0)

    def update(self, record: Mapping[str, Any]) -> None:
        """Take one step record (the fields of a metrics ``step`` line)."""
        if self.last is None:
            self._first_step = int(record["step"]) - 1
        self.steps, self.last = int(record["step"]), record

    def line(self) -> str:
        """The live line, as of now."""
        elapsed = self._clock() - self.started
        parts = [f"step {self.steps}/{self.total}" if self.total is not None else f"step {self.steps}"]
        parts += self._last_step_parts()
        parts.append(f"elapsed {duration(elapsed)}")
        eta = self.eta(elapsed)
        if eta is not None:
            parts.append(f"ETA {duration(eta)}")
        return "  ".join(parts)

    def _last_step_parts(self) -> list[str]:
        if self.last is None:
            return []
        parts = []
        if self.last.get("reward_mean") is not None:
            parts.append(f"reward {self.last['reward_mean']:.3f} ± {self.last['reward_std']:.3f}")
        if self.last.get("tokens_per_s") is not None:
            parts.append(f"{self.last['tokens_per_s']:.0f} tok/s")
        return parts

    def eta(self, elapsed: float) -> float | None:
        """Seconds left at the mean step time so far (None before a step or without a total)."""
        done = self.steps - self._first_step
        if self.total is None or self.last is None or done <= 0:
            return None
        return elapsed / done * max(self.total - self.steps, 0)

    def summary(
        self,
        *,
        metrics: str | None,
        checkpoints: str | None,
        rank: tuple[str, bool] | None = None,
        tensorboard: str | None = None,
    ) -> str:
        """The one line that ends a run: steps, time, last reward, where the outputs went.

        ``rank``: in a data-parallel launch, this rank's label (``"rank 1 of 2"``) and whether it
        writes the files; a rank that does not reports its steps only (its reward would be of its
        own groups)."""
        elapsed = duration(self._clock() - self.started)
        steps = f"{self.steps}/{self.total}" if self.total is not None else str(self.steps)
        label = "" if rank is None else f"{rank[0]}: "
        text = f"thundersync: {label}{steps} steps in {elapsed}"
        if rank is not None and not rank[1]:
            return text + "; no files (rank 0 writes the metrics and checkpoints)"
        if self.last is not None and self.last.get("reward_mean") is not None:
            text += f", last reward {self.last['reward_mean']:.3f}"
        text += f"; metrics: {printable(metrics) if metrics else 'not written (no --metrics)'}"
        if tensorboard is not None:
            text += f"; tensorboard: {printable(tensorboard)}"
        if checkpoints is not None:
            text += f"; checkpoints: {printable(checkpoints)}"
        return text


async def show_progress(progress: Progress, stream: TextIO, interval_s: float) -> None:
    """Redraw the live line on ``stream`` every ``interval_s`` until cancelled; ends the line then."""
    try:
        while True:
            stream.write(_REDRAW + progress.line())
            stream.flush()
            await anyio.sleep(interval_s)
    finally:
        stream.write(_REDRAW + progress.line() + "\n")
        stream.flush()
