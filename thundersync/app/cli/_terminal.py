"""What the ``thundersync`` command writes to a terminal: escaped text, the screen, logs and warnings (private).

Names in a pipeline file (stages, objects, paths) are the user's strings and may hold control
characters; printed raw, ``"\\x1b[2J"`` would clear the screen and ``"\\n"`` would fake an output
line. Everything the command prints that can carry such a string goes through :func:`printable`,
which writes each non-printable character the way ``repr`` does (``\\x1b``, ``\\n``, ``\\u202e``).

A :class:`Screen` owns stderr while a command runs: the live progress line (redrawn in place on a
terminal) and every other line written above it, so a log record or a warning never draws over the
live line. Logs (structlog and :mod:`logging`) and warnings go through it (:func:`configure_logging`,
:meth:`Screen.routing`); a warning is one line, ``thundersync: warning: Category: message``, without
Python's echo of the source line that raised it, and each distinct one is shown once.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from time import perf_counter
from typing import Any, TextIO, cast

import structlog

__all__ = ["Screen", "configure_logging", "printable"]

_REDRAW = "\r\x1b[K"  # back to the line's start, then clear it


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped as ``repr`` escapes it; spaces stay."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _escape_values(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: string values (the message included) made printable."""
    return {key: printable(value) if isinstance(value, str) else value for key, value in event.items()}


class _PrintableFormatter(logging.Formatter):
    """The standard formatter with the message line made printable (tracebacks stay as they are)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


def configure_logging(verbose: bool, stream: TextIO | io.TextIOBase | None = None) -> None:
    """Logs to ``stream`` (None: stderr): warnings and errors, or info too when ``verbose``; the only
    place that sets handlers."""
    stream = sys.stderr if stream is None else stream
    level = logging.INFO if verbose else logging.WARNING
    structlog.configure(
        processors=[
            _escape_values,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(cast(TextIO, stream)),  # it only writes and flushes
        cache_logger_on_first_use=False,
    )
    # The library's own loggers write through the standard logging module (thundersync._logging).
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_PrintableFormatter("%(asctime)s [%(levelname)s] %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


class Screen:
    """stderr (``stream``) while a command runs: the live line from ``line`` (when ``live``: redrawn
    in place, at most every ``interval_s`` on a change) and the lines said above it. Without a live
    line, a change worth a line is written as ``thundersync: LINE``. Thread-safe (logs come from
    worker threads too)."""

    def __init__(
        self,
        stream: TextIO,
        line: Callable[[], str],
        *,
        live: bool,
        interval_s: float = 0.2,
        clock: Callable[[], float] = perf_counter,
    ) -> None:
        self.stream, self.live, self._line, self._interval_s, self._clock = stream, live, line, interval_s, clock
        self._lock = threading.RLock()
        self._drawn = False  # the live line is on screen (no newline after it)
        self._closed = False
        self._last_draw = float("-inf")
        self._warned: set[str] = set()

    def changed(self, *, line: bool = False) -> None:
        """The progress changed: redraw the live line (rate-limited), or write it when ``line`` and not live."""
        if self.live:
            if self._clock() - self._last_draw >= self._interval_s:
                self.redraw()
        elif line:
            self.say(f"thundersync: {self._line()}")

    def redraw(self) -> None:
        """Draw the live line now (nothing when not live or closed)."""
        with self._lock:
            if not self.live or self._closed:
                return
            self.stream.write(_REDRAW + self._line())
            self.stream.flush()
            self._drawn, self._last_draw = True, self._clock()

    def say(self, text: str) -> None:
        """Write ``text`` as a line of its own, above the live line."""
        with self._lock:
            self.stream.write((_REDRAW if self._drawn else "") + text + "\n")
            if self._drawn:
                self.stream.write(self._line())
            self.stream.flush()

    def close(self) -> None:
        """End the live line (its last state stays on screen); later lines are plain lines."""
        with self._lock:
            if self.live and not self._closed:
                self.stream.write(_REDRAW + self._line() + "\n")
                self.stream.flush()
            self._drawn, self._closed = False, True

    def warning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        """A :func:`warnings.showwarning`: one line, the category and the message, escaped; each
        distinct one once (code that resets the warning filters per object would repeat it)."""
        text = f"thundersync: warning: {category.__name__}: {printable(str(message))}"
        with self._lock:
            if text in self._warned:
                return
            self._warned.add(text)
        self.say(text)

    @contextmanager
    def routing(self, verbose: bool) -> Iterator[Screen]:
        """Logs and warnings through this screen for the block; stderr's again after it."""
        shown = warnings.showwarning
        warnings.showwarning = self.warning
        configure_logging(verbose, _Lines(self))
        try:
            yield self
        finally:
            self.close()  # a failure's line goes below the live line's last state
            warnings.showwarning = shown
            configure_logging(verbose)


class _Lines(io.TextIOBase):
    """A text stream that hands each complete line written to it to a :class:`Screen`."""

    def __init__(self, screen: Screen) -> None:
        super().__init__()
        self._screen, self._pending = screen, ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._screen.say(line)
        return len(text)
