"""Library loggers: structlog on top of the standard ``logging`` module, quiet by default.

The library configures no handlers. Its loggers (``thundersync.<module>``) pass key-value
rendered records to :mod:`logging`, so nothing below WARNING appears unless the application
(or the ``thundersync`` CLI) configures logging, e.g. ``logging.basicConfig(level="INFO")``.
A disabled level costs one ``isEnabledFor`` check.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["get_logger"]


def get_logger(name: str) -> Any:
    """A structlog logger named ``name`` that writes through ``logging.getLogger(name)``."""
    return structlog.wrap_logger(
        logging.getLogger(name),
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=True),
        ],
    )
