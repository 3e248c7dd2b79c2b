"""``python -m thundersync`` is the ``thundersync`` command (see :mod:`thundersync.app.cli.command`)."""

from __future__ import annotations

from thundersync.app.cli.command import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
