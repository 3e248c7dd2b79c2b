"""Where a ``transformers-teacher`` loads its model from: a model directory, or a run's newest checkpoint.

Torch-free, so that ``thundersync check`` and ``run``'s checks before building (:mod:`thundersync.app.files.preflight`)
find a missing teacher before any model is built or trained.
"""

from __future__ import annotations

import re
from pathlib import Path

from thundersync.errors import ConfigError

__all__ = ["teacher_directory"]


def teacher_directory(path: Path) -> Path:
    """``path`` if it holds a model, else its newest complete ``step-N`` checkpoint that holds one."""
    if (path / "config.json").is_file():
        return path
    # thundersync.app.checkpoints.checkpoint's layout (the app layer sits above this one): step-N, complete once
    # its checkpoint.json is written
    found = [
        (int(match[1]), child)
        for child in (path.iterdir() if path.is_dir() else ())
        if (match := re.fullmatch(r"step-(\d+)", child.name))
        and (child / "checkpoint.json").is_file()
        and (child / "config.json").is_file()
    ]
    if not found:
        raise ConfigError(
            f"the teacher path {str(path)!r} is not a model directory (no config.json) and holds no checkpoint "
            "of full weights (no step-N/checkpoint.json); save a model there, or train the teacher first "
            "(thundersync run examples/agent_grpo.toml writes runs/agent_grpo)"
        )
    return max(found)[1]
