"""``python -m thundersync`` is the ``thundersync`` command (see :mod:`thundersync.pipeline.cli`)."""

from __future__ import annotations

from thundersync.pipeline.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
