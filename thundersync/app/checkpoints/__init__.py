"""Checkpoints: atomic saves every N steps and at the end of a run, and a resume (bitwise on CPU
under ``[run] deterministic``: :mod:`thundersync.app.checkpoints.checkpoint`).

``checkpoint`` holds the :class:`Checkpointer` that the step stage calls; ``run_directory`` the
run that owns a checkpoint directory and :func:`preflight`, the checks ``thundersync run`` makes
before it builds anything (no torch); ``_checkpoint_files`` the directory's layout (atomic
publication, retention, weights). The Checkpointer is imported on first use, so that importing
this package for :func:`preflight` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from thundersync.app.checkpoints.run_directory import Preflight, find_checkpoint, preflight

if TYPE_CHECKING:
    from thundersync.app.checkpoints.checkpoint import Checkpointer, RandomSource

__all__ = ["Checkpointer", "Preflight", "RandomSource", "find_checkpoint", "preflight"]


def __getattr__(name: str) -> Any:
    if name in ("Checkpointer", "RandomSource"):
        from thundersync.app.checkpoints import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
