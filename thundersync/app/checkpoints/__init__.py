"""Checkpoints: atomic saves every N steps and at the end of a run, and a resume (bitwise on CPU
under ``[run] deterministic``: :mod:`thundersync.app.checkpoints.checkpoint`).

``checkpoint`` holds the :class:`Checkpointer` that the step stage calls; ``_checkpoint_files`` the
directory's layout (atomic publication, retention, weights).
"""

from __future__ import annotations

from thundersync.app.checkpoints.checkpoint import Checkpointer, RandomSource

__all__ = ["Checkpointer", "RandomSource"]
