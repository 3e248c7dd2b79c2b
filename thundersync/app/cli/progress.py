"""What ``thundersync run`` shows on stderr: one live line for every long phase, and a summary line.

Each long phase reports itself (:mod:`thundersync.app.phases`): building the file's objects, a
warm-up (``supervised-warmup``), then the optimizer steps. The live line (on a terminal, or with
``--progress``) shows the phase running now, redrawn in place (:class:`~thundersync.app.cli._terminal.Screen`)::

    build 2/17 objects  object model  elapsed 0:00:00
    warm-up 120/450 steps  3.2 steps/s  loss 1.204  elapsed 0:00:37  ETA 0:01:43
    step 3/10  reward 0.412 ± 0.118  812 tok/s  elapsed 0:00:12  ETA 0:00:28

A phase's rate is its units done over its elapsed time, its ``ETA`` that rate applied to the
units left (shown once a unit is done and the total is known, for phases whose units take alike
times: not the build's objects). For the steps, ``reward`` is the
last step's batch mean ± standard deviation, ``tok/s`` the last step's generated tokens over its
duration, ``ETA`` the mean step time so far times the steps left, and ``no signal`` follows the
reward while every group of the last step had equal rewards (``groups_without_signal``). A phase
that asks for it (the warm-up) leaves its last line when it ends, live or not. The summary line
ends a successful run whether or not stderr is a terminal (a failed run ends with its error line);
it gives each phase's time, a nested one inside its parent's, and the whole run's::

    thundersync: 10/10 steps in 0:00:41 (build 0:01:35 (warm-up 0:01:32), steps 0:00:41; total 0:02:16), last reward 0.620; metrics: runs/a/metrics.jsonl; checkpoints: runs/a

In a data-parallel launch every rank ends with its line; rank 0 alone writes files (and shows the
live line), the others say so::

    thundersync: rank 1 of 2: 10/10 steps in 0:00:41 (...); no files (rank 0 writes the metrics and checkpoints)

Paths come from the user and are printed escaped (:func:`~thundersync.app.cli._terminal.printable`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Protocol

import anyio

from thundersync.app.cli._terminal import Screen, printable

__all__ = ["STEPS", "Display", "Progress", "duration", "show_progress"]

STEPS = "steps"
"""The name of the optimizer steps' phase (its line is the step line)."""


def duration(seconds: float) -> str:
    """``H:MM:SS`` (whole seconds)."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Display(Protocol):
    """Where a :class:`Progress` tells its changes: ``changed`` (``line``: worth a line where there is
    no live line) and ``say`` (a line of its own)."""

    def changed(self, *, line: bool = False) -> None: ...

    def say(self, text: str) -> None: ...


@dataclass
class _Phase:
    name: str
    total: int | None
    unit: str
    record: bool
    even: bool
    started: float
    depth: int
    ended: float | None = None
    done: int = 0
    shown: dict[str, str] = field(default_factory=dict)


class Progress:
    """The state behind the live and summary lines: the phases so far, and the steps done of
    ``total`` (None: unknown). It is the run's :class:`~thundersync.app.phases.Reporter`."""

    def __init__(self, total: int | None, *, clock: Callable[[], float] = perf_counter) -> None:
        self.total = total
        self._clock = clock
        self.started = clock()
        self.steps = 0
        self.last: Mapping[str, Any] | None = None
        self._first_step = 0  # the step count this run started from (a resumed run's is > 0)
        self.phases: list[_Phase] = []
        self._open: list[_Phase] = []
        self.display: Display | None = None

    # ---- phases (thundersync.app.phases.Reporter) ----

    def begin(
        self, name: str, *, total: int | None = None, unit: str = STEPS, record: bool = False, even: bool = True
    ) -> None:
        """A phase starts (inside the one open now, if any); ``even``: show its rate and ETA."""
        started = _Phase(name, total, unit, record, even, self._clock(), len(self._open))
        self.phases.append(started)
        self._open.append(started)
        self._changed(line=record)  # without a live line, a recorded phase (the warm-up) says it started

    def advance(self, done: int, *, line: bool = False, **shown: str) -> None:
        """The open phase has ``done`` units done; ``shown``: values for its line."""
        current = self._open[-1]
        current.done = done
        current.shown.update(shown)
        self._changed(line=line)

    def end(self) -> None:
        """The open phase ends; one that asked for it leaves its line."""
        current = self._open.pop()
        current.ended = self._clock()
        if current.record and self.display is not None:
            self.display.say(f"thundersync: {self._phase_line(current, final=True)}")
        self._changed()

    @contextmanager
    def steps_phase(self) -> Iterator[None]:
        """The optimizer steps' phase, for the block."""
        self.begin(STEPS, total=self.total)
        try:
            yield
        finally:
            self.end()

    def _changed(self, *, line: bool = False) -> None:
        if self.display is not None:
            self.display.changed(line=line)

    # ---- the steps ----

    def update(self, record: Mapping[str, Any]) -> None:
        """Take one step record (the fields of a metrics ``step`` line)."""
        if self.last is None:
            self._first_step = int(record["step"]) - 1
        self.steps, self.last = int(record["step"]), record
        self._changed()

    def line(self) -> str:
        """The live line, as of now: the innermost open phase's (the step line outside any)."""
        if self._open and self._open[-1].name != STEPS:
            return self._phase_line(self._open[-1])
        elapsed = self._steps_elapsed()
        parts = [f"step {self.steps}/{self.total}" if self.total is not None else f"step {self.steps}"]
        parts += self._last_step_parts()
        parts.append(f"elapsed {duration(elapsed)}")
        eta = self.eta(elapsed)
        if eta is not None:
            parts.append(f"ETA {duration(eta)}")
        return "  ".join(parts)

    def _phase_line(self, phase: _Phase, *, final: bool = False) -> str:
        elapsed = (phase.ended if phase.ended is not None else self._clock()) - phase.started
        count = f"{phase.done}/{phase.total}" if phase.total is not None else f"{phase.done}"
        parts = [f"{phase.name} {count} {phase.unit}" + (f" in {duration(elapsed)}" if final else "")]
        if phase.even and phase.done > 0 and elapsed > 0:
            parts.append(f"{phase.done / elapsed:.3g} {phase.unit}/s")
        parts += [f"{key} {value}" for key, value in phase.shown.items() if value]
        if not final:
            parts.append(f"elapsed {duration(elapsed)}")
            if phase.even and phase.total is not None and phase.done > 0:
                parts.append(f"ETA {duration(elapsed / phase.done * max(phase.total - phase.done, 0))}")
        return "  ".join(parts)

    def _steps_elapsed(self) -> float:
        steps = [p for p in self.phases if p.name == STEPS]
        if not steps:
            return self._clock() - self.started
        return (steps[-1].ended if steps[-1].ended is not None else self._clock()) - steps[-1].started

    def _last_step_parts(self) -> list[str]:
        if self.last is None:
            return []
        parts = []
        if self.last.get("reward_mean") is not None:
            reward = f"reward {self.last['reward_mean']:.3f} ± {self.last['reward_std']:.3f}"
            groups, flat = self.last.get("groups_rewarded"), self.last.get("groups_without_signal")
            if groups and flat == groups:
                reward += " (no signal: every group's rewards equal)"
            parts.append(reward)
        if self.last.get("tokens_per_s") is not None:
            parts.append(f"{self.last['tokens_per_s']:.0f} tok/s")
        return parts

    def eta(self, elapsed: float) -> float | None:
        """Seconds left at the mean step time so far (None before a step or without a total)."""
        done = self.steps - self._first_step
        if self.total is None or self.last is None or done <= 0:
            return None
        return elapsed / done * max(self.total - self.steps, 0)

    def timings(self) -> str:
        """Every phase's time, nested ones inside their parent's, and the total: ``""`` when the
        steps were the only phase."""
        if all(p.name == STEPS for p in self.phases):
            return ""
        now = self._clock()

        def text(index: int) -> tuple[str, int]:
            phase, inner, at = self.phases[index], [], index + 1
            while at < len(self.phases) and self.phases[at].depth > phase.depth:
                part, at = text(at)
                inner.append(part)
            took = duration((phase.ended if phase.ended is not None else now) - phase.started)
            return f"{phase.name} {took}" + (f" ({', '.join(inner)})" if inner else ""), at

        parts, at = [], 0
        while at < len(self.phases):
            part, at = text(at)
            parts.append(part)
        return f"{', '.join(parts)}; total {duration(now - self.started)}"

    def summary(
        self,
        *,
        metrics: str | None,
        checkpoints: str | None,
        rank: tuple[str, bool] | None = None,
        tensorboard: str | None = None,
    ) -> str:
        """The one line that ends a run: steps, each phase's time, last reward, where the outputs went.

        ``rank``: in a data-parallel launch, this rank's label (``"rank 1 of 2"``) and whether it
        writes the files; a rank that does not reports its steps only (its reward would be of its
        own groups)."""
        elapsed = duration(self._steps_elapsed())
        steps = f"{self.steps}/{self.total}" if self.total is not None else str(self.steps)
        label = "" if rank is None else f"{rank[0]}: "
        timings = self.timings()
        text = f"thundersync: {label}{steps} steps in {elapsed}" + (f" ({timings})" if timings else "")
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


async def show_progress(screen: Screen, interval_s: float) -> None:
    """Redraw the live line on ``screen`` every ``interval_s`` until cancelled (the elapsed time
    moves between updates); ends the line then, leaving it on screen."""
    try:
        while True:
            screen.redraw()
            await anyio.sleep(interval_s)
    finally:
        screen.close()
