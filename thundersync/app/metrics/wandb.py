"""Weights & Biases: the step and eval records as W&B metrics (``[run.wandb]``; ``pip install 'thundersync[wandb]'``).

::

    [run.wandb]
    project = "agent-grpo"
    mode = "offline"            # "online", "offline" (no network: sync later with `wandb sync`), "disabled"
    dir = "runs/wandb"          # where the run's files go (default: the working directory)

:class:`WandbSteps` opens one W&B run when the metrics file opens, logs the pipeline file's
settings as the run's config once (its stages, objects, ``[run]`` and ``[eval]`` tables), then
every numeric key of each ``step`` and ``eval`` record (the same keys as the metrics file:
``reward_mean``, ``grad_norm``, ``eval_pass_at_k``...) at the record's ``step``, and finishes the
run when the metrics file closes (exit code 1 when the run failed). Keys whose value is ``null``
or not a number are left out. Under a data-parallel launch only rank 0 writes it, as it writes
the metrics file. ``mode`` unset leaves the choice to W&B (``WANDB_MODE``, else online).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal

import msgspec

from thundersync.errors import ConfigError, MissingExtraError

__all__ = ["WandbSettings", "WandbSteps", "require_wandb"]


class WandbSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``[run.wandb]``: the W&B run's ``project``, ``name``, ``entity``, ``group``, ``tags``,
    ``mode`` (``online``, ``offline``, ``disabled``; None: W&B's own choice) and ``dir``."""

    project: str = "thundersync"
    name: str | None = None
    entity: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()
    mode: Literal["online", "offline", "disabled"] | None = None
    dir: str | None = None


def require_wandb() -> Any:
    """The ``wandb`` module, or a :class:`MissingExtraError` saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise MissingExtraError("run.wandb", "wandb", "wandb", alone="wandb") from None
    return wandb


class WandbSteps:
    """Logs step and eval records to one W&B run (module docstring); ``config``: the run's settings."""

    def __init__(self, settings: WandbSettings, *, config: Mapping[str, Any] | None = None) -> None:
        self.settings, self.config = settings, dict(config or {})
        self.run: Any = None

    def __enter__(self) -> WandbSteps:
        wandb = require_wandb()
        s = self.settings
        try:
            self.run = wandb.init(
                project=s.project,
                name=s.name,
                entity=s.entity,
                group=s.group,
                tags=list(s.tags) or None,
                mode=s.mode,
                dir=s.dir,
                config=self.config,
                settings=wandb.Settings(silent=True),
            )
        except Exception as error:  # wandb's own: a bad dir, no login for online mode...
            raise ConfigError(
                f'cannot start the W&B run (run.wandb): {type(error).__name__}: {error}; set mode = "offline" '
                "to log without a network, or fix the setting it names"
            ) from None
        return self

    def add(self, record: Mapping[str, Any]) -> None:
        """Log the numeric values of one record at its ``step``."""
        if self.run is None:
            return
        values = {
            key: value
            for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        self.run.log(values, step=int(record["step"]))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish(exit_code=0 if exc_type is None else 1)
