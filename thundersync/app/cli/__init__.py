"""The ``thundersync`` command: ``check``, ``run`` and ``plot`` (also ``python -m thundersync``).

``command`` parses the command line and runs it; ``distributed`` reads a torchrun launch, ``progress``
draws the live progress line. See :mod:`thundersync.app.cli.command` for the options.
"""

from __future__ import annotations

from thundersync.app.cli.command import main

__all__ = ["main"]
