"""TensorBoard scalars of each step line: ``[run] tensorboard = "DIR"``.

:class:`TensorBoardSteps` takes the step records that the metrics file writes as ``"event":
"step"`` lines (:class:`~thundersync.app.metrics.jsonl.JsonlMetrics` hands each one on) and writes
every numeric key of each as a scalar through ``torch.utils.tensorboard.SummaryWriter``: the tag
is the key (``reward_mean``, ``grad_norm``, ``tokens_per_s``...), the global step the record's
``step``. Keys whose value is ``null`` or not a number (``groups_per_rank``) are left out. The
event file is flushed after each step and closed when the run ends, whichever way.

The directory is created when it does not exist. One that already holds event files
(``events.out.tfevents.*``) is refused, since TensorBoard would draw the two runs as one, unless

- ``overwrite`` (``thundersync run --overwrite``): those event files are deleted first (only
  regular files named ``events.out.tfevents.*``: a directory, link or other file of that name is
  left in place, as is every other file);
- ``resume_step`` is given (``thundersync run --resume``): a new event file is added beside them,
  and TensorBoard hides what the earlier run wrote from step ``resume_step + 1`` on (its
  ``purge_step``), the steps the resumed run writes again. A resume never deletes anything.

``pip install tensorboard`` (it is in the ``train`` extra); :func:`require_tensorboard` says so.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from thundersync.errors import ConfigError, MissingExtraError

__all__ = ["EVENT_FILES", "TensorBoardSteps", "require_tensorboard"]

EVENT_FILES = "events.out.tfevents.*"
"""The names of TensorBoard's event files (a glob)."""


def require_tensorboard() -> None:
    """A :class:`MissingExtraError` saying how to install it when the tensorboard package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise MissingExtraError("run.tensorboard", "train", "tensorboard", alone="tensorboard") from None


class TensorBoardSteps:
    """Write step records to TensorBoard event files in ``directory`` (see the module docstring)."""

    def __init__(self, directory: str | Path, *, overwrite: bool = False, resume_step: int | None = None) -> None:
        self.directory = Path(directory)
        self.overwrite, self.resume_step = overwrite, resume_step
        self._writer: Any = None

    def __enter__(self) -> TensorBoardSteps:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self._clear()
        purge = None if self.resume_step is None else self.resume_step + 1
        try:
            self._writer = SummaryWriter(str(self.directory), purge_step=purge)
        except OSError as error:
            raise ConfigError(
                f"cannot write TensorBoard files in {self.directory}: {error.strerror or error}; give "
                "run.tensorboard a directory on a writable file system"
            ) from None
        return self

    def check(self) -> list[Path]:
        """The ConfigError that opening would raise, found without changing anything (``thundersync
        check``, and ``run`` before it builds anything); else the event files opening would delete."""
        if self.directory.exists() and not self.directory.is_dir():
            raise ConfigError(f"run.tensorboard = {str(self.directory)!r} is not a directory; give a directory")
        old = _event_files(self.directory) if self.resume_step is None else []
        if old and not self.overwrite:
            raise ConfigError(
                f"the TensorBoard directory {self.directory} already holds {len(old)} event file(s) of an earlier "
                "run, which TensorBoard would draw as one run with this one; give run.tensorboard a new "
                "directory, or delete them with --overwrite (--resume adds to them)"
            )
        return old

    def _clear(self) -> None:
        """Refuse, or delete, the event files of an earlier run (not when resuming)."""
        for path in self.check():
            path.unlink()

    def add(self, record: Mapping[str, Any]) -> None:
        """Write the numeric values of one step record at its ``step``, and flush."""
        if self._writer is None:
            return
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _event_files(directory: Path) -> list[Path]:
    """The regular files named like event files in ``directory`` (links are not followed)."""
    return sorted(path for path in directory.glob(EVENT_FILES) if stat.S_ISREG(os.lstat(path).st_mode))
