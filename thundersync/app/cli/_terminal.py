"""What the ``thundersync`` command writes to a terminal: escaped text and its log configuration (private).

Names in a pipeline file (stages, objects, paths) are the user's strings and may hold control
characters; printed raw, ``"\\x1b[2J"`` would clear the screen and ``"\\n"`` would fake an output
line. Everything the command prints that can carry such a string goes through :func:`printable`,
which writes each non-printable character the way ``repr`` does (``\\x1b``, ``\\n``, ``\\u202e``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

__all__ = ["configure_logging", "printable"]


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


def configure_logging(verbose: bool) -> None:
    """Logs to stderr: warnings and errors, or info too when ``verbose``; the only place that sets handlers."""
    level = logging.INFO if verbose else logging.WARNING
    structlog.configure(
        processors=[
            _escape_values,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    # The library's own loggers write through the standard logging module (thundersync._logging).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_PrintableFormatter("%(asctime)s [%(levelname)s] %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
