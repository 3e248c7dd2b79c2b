"""The long phases of a run (building the objects, a warm-up, the steps) as work reports them.

The seam between code that does long work and the display that shows it
(:class:`thundersync.app.cli.progress.Progress` under ``thundersync run``)::

    with phase("warm-up", total=450, unit="steps", record=True) as advance:
        for step in range(1, 451):
            ...
            advance(step, loss="2.314")          # shown on the live line; done = step

A reporter is installed for a block with :func:`reporting` (a context variable: it reaches the
code the block calls, threads and tasks started inside it included); without one, :func:`phase`
reports nothing (the library prints nothing by itself). ``record``: the phase leaves a line of its
own when it ends (and, where there is no live line, when ``advance`` is given ``line=True``);
``even``: its units take about the same time each, so a rate and an ETA mean something (the
objects of a build do not: one of them may be a 15-minute warm-up).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

__all__ = ["Advance", "Reporter", "phase", "reporting"]


class Advance(Protocol):
    """Report ``done`` units of the current phase; ``shown``: short values for its line (``loss="2.31"``);
    ``line``: worth a line of its own where there is no live line."""

    def __call__(self, done: int, *, line: bool = False, **shown: str) -> None: ...


class Reporter(Protocol):
    """What a progress display implements to be told of phases (one open at a time per nesting level)."""

    def begin(self, name: str, *, total: int | None, unit: str, record: bool, even: bool) -> None: ...

    def advance(self, done: int, *, line: bool = False, **shown: str) -> None: ...

    def end(self) -> None: ...


_REPORTER: ContextVar[Reporter | None] = ContextVar("thundersync_phase_reporter", default=None)


@contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Send the phases of the code run inside the block to ``reporter``."""
    token = _REPORTER.set(reporter)
    try:
        yield reporter
    finally:
        _REPORTER.reset(token)


def _ignore(done: int, *, line: bool = False, **shown: str) -> None:
    return None


@contextmanager
def phase(
    name: str, *, total: int | None = None, unit: str = "steps", record: bool = False, even: bool = True
) -> Iterator[Advance]:
    """A phase of ``total`` ``unit`` (None: not counted in advance) for the block; yields the
    function that reports progress (it does nothing without a reporter)."""
    reporter = _REPORTER.get()
    if reporter is None:
        yield _ignore
        return
    reporter.begin(name, total=total, unit=unit, record=record, even=even)
    try:
        yield reporter.advance
    finally:
        reporter.end()
