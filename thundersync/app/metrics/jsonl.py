"""`JsonlMetrics`: per-step metrics, lifecycle events and per-stage statistics as JSON lines.

Every line is a JSON object with an ``event`` (``step``, an event's class name, ``run_started``,
``stage_statistics`` or ``run_finished``) and ``t``, the seconds since the sink was opened::

    {"t":0.0,"event":"run_started","file":"examples/pipeline_fake.toml","stages":["source",...]}
    {"t":0.011,"event":"GroupClosed","group_id":0,"num_trajectories":4}
    {"t":0.012,"event":"StepDone","batch_id":0,"policy_version":1,"grad_norm":0.0,...}
    {"t":0.012,"event":"step","step":1,"reward_mean":0.41,"reward_std":0.12,"step_s":0.012,...}
    {"t":0.9,"event":"stage_statistics","name":"reward","state":"done","received":1640,...}
    {"t":0.9,"event":"run_finished","status":"ok","elapsed_s":0.9}

The ``step`` lines (one per optimizer step; :mod:`thundersync.app.metrics.step_metrics` defines each
key) are what other tools read: ``thundersync plot`` draws them; ``eval`` lines (``[eval]``:
:mod:`thundersync.app.evaluation`) hold an evaluation run's ``eval_*`` keys at its ``step``. Given
``tensorboard`` (:class:`~thundersync.app.metrics.tensorboard.TensorBoardSteps`, ``[run] tensorboard``)
or other ``sinks`` (:class:`~thundersync.app.metrics.wandb.WandbSteps`, ``[run.wandb]``), the sink
also hands each step and eval record to them, opens them with itself and closes them with itself.

Lines reach the file as they are written (no buffer), so a crashed run leaves every line up to the crash.

The file is created new, in a directory that must already exist; an existing file is replaced
only with ``overwrite=True`` (``thundersync run --overwrite``), or added to with ``append=True``
(``thundersync run --resume``), and then only if it is a regular file with no other hard link: the
sink never writes through a symbolic link (``O_NOFOLLOW``), into a device or a FIFO, and never
truncates a file that other names share (``st_nlink > 1``). Each refusal is a
:class:`~thundersync.errors.ConfigError` that names the path and what to do;
:func:`check_metrics_path` finds it without touching the file.
"""

from __future__ import annotations

import errno
import io
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import Any, Protocol

import msgspec

from thundersync.app.metrics.tensorboard import TensorBoardSteps
from thundersync.app.paths import file_kind
from thundersync.errors import ConfigError
from thundersync.events import EventBase
from thundersync.pipeline.runner import RunStatistics

__all__ = ["JsonlMetrics", "RecordSink", "check_metrics_path"]

RECORDS = ("step", "eval")
"""The events whose records go to TensorBoard and the other sinks too."""


class RecordSink(Protocol):
    """Where step and eval records also go: opened and closed with the metrics file."""

    def __enter__(self) -> Any: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> Any: ...

    def add(self, record: Mapping[str, Any]) -> None:
        """Take one record (it has a ``step``)."""
        ...


_HINT = "give --metrics (or run.metrics) the path of a new file"


class JsonlMetrics:
    """Write metric records to ``path`` (``None``: a sink that drops everything).

    ``overwrite``: replace an existing regular file instead of refusing to open; ``append``: add to an
    existing regular file (``thundersync run --resume`` without ``--overwrite``: the resumed run's lines
    follow the first's; ``overwrite`` wins over it); ``tensorboard``:
    where the step records also go (None: nowhere else); ``sinks``: other places they go.
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        overwrite: bool = False,
        append: bool = False,
        tensorboard: TensorBoardSteps | None = None,
        sinks: Sequence[RecordSink] = (),
    ) -> None:
        self.path = None if path is None else Path(path)
        self.overwrite, self.append = overwrite, append
        self.tensorboard = tensorboard
        self.sinks: list[RecordSink] = [*([tensorboard] if tensorboard is not None else []), *sinks]
        self._opened: list[RecordSink] = []
        self._file: io.FileIO | None = None
        self._encoder = msgspec.json.Encoder()
        self._start = perf_counter()
        self.lines = 0

    def __enter__(self) -> JsonlMetrics:
        if self.path is not None:
            self._file = _open_new(self.path, overwrite=self.overwrite, append=self.append)
        self._opened = []
        for sink in self.sinks:
            try:
                sink.__enter__()
            except BaseException:
                self.__exit__(None, None, None)
                raise
            self._opened.append(sink)
        self._start = perf_counter()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            for sink in reversed(self._opened):
                sink.__exit__(exc_type, exc, traceback)
        finally:
            self._opened = []
            if self._file is not None:
                self._file.close()
                self._file = None

    def write(self, event: str, **fields: Any) -> None:
        """Write one record ``{"t": ..., "event": event, **fields}`` (a ``step`` or ``eval`` record also
        to TensorBoard and the other sinks)."""
        if event in RECORDS:
            for sink in self.sinks:
                sink.add(fields)
        if self._file is None:
            return
        record = {"t": round(perf_counter() - self._start, 6), "event": event, **fields}
        line = memoryview(self._encoder.encode(record) + b"\n")
        while line:  # unbuffered: each line reaches the file now, and a failed write is not retried at close
            line = line[self._file.write(line) :]
        self.lines += 1

    def event(self, event: EventBase) -> None:
        """Write one pipeline event (its fields; ``event`` is its class name)."""
        fields = msgspec.to_builtins(event)
        self.write(fields.pop("type"), **fields)

    def statistics(self, stats: RunStatistics) -> None:
        """Write one ``stage_statistics`` line per stage."""
        for stage in stats.stages.values():
            self.write("stage_statistics", **msgspec.to_builtins(stage))


def _open_new(path: Path, *, overwrite: bool, append: bool = False) -> io.FileIO:
    """``path`` opened for writing from its start (at its end: ``append``), or a ConfigError saying
    why it may not be."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # a FIFO must not block us
    append = append and not overwrite
    flags |= os.O_APPEND if append else 0
    try:
        fd = os.open(path, flags if overwrite or append else flags | os.O_EXCL, 0o644)
    except OSError as error:
        raise _refusal(path, error) from None
    try:
        status = os.fstat(fd)
        kind = file_kind(status.st_mode)
        if kind != "regular file":
            raise ConfigError(f"the metrics path {path} is a {kind}, not a regular file; {_HINT}")
        if status.st_nlink > 1:  # truncating it would empty the file under its other names too
            raise _linked(path, status.st_nlink)
        os.set_blocking(fd, True)
        if not append:
            os.ftruncate(fd, 0)
    except OSError as error:
        os.close(fd)
        raise _refusal(path, error) from None
    except BaseException:
        os.close(fd)
        raise
    return io.FileIO(fd, "wb")


def check_metrics_path(path: str | Path | None, *, overwrite: bool = False, append: bool = False) -> None:
    """The refusals of :class:`JsonlMetrics` that need no file opened, callable before a run builds
    anything (``thundersync check``, and ``run`` before it builds anything): a link, device, FIFO or
    directory in place of ``path``, an existing file without ``overwrite`` or ``append``, one with
    other hard links, a missing or unwritable directory. Creates, opens and changes nothing."""
    if path is None:
        return
    path = Path(path)
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise _refusal(path, FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))) from None
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise _refusal(path, PermissionError(errno.EACCES, os.strerror(errno.EACCES))) from None
        return
    except OSError as error:
        raise _refusal(path, error) from None
    kind = file_kind(status.st_mode)
    if kind != "regular file":
        raise ConfigError(f"the metrics path {path} is a {kind}, not a regular file; {_HINT}")
    if not (overwrite or append):
        raise _refusal(path, FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST)))
    if status.st_nlink > 1:
        raise _linked(path, status.st_nlink)
    if not os.access(path, os.W_OK):
        raise _refusal(path, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))


def _linked(path: Path, links: int) -> ConfigError:
    return ConfigError(
        f"the metrics file {path} has {links} hard links, and --overwrite would empty it under every other "
        f"name too; {_HINT}, or remove this name first"
    )


def _refusal(path: Path, error: OSError) -> ConfigError:
    """Why ``path`` cannot be the metrics file, as one message that says what to do."""
    try:
        kind: str | None = file_kind(os.lstat(path).st_mode)
    except OSError:
        kind = None
    if kind == "regular file" and error.errno == errno.EEXIST:
        return ConfigError(
            f"the metrics file {path} already exists and is never overwritten silently; choose a new "
            "path, or replace it with --overwrite (overwrite=True in Python)"
        )
    if kind is not None and kind != "regular file":
        return ConfigError(f"the metrics path {path} is a {kind}, not a regular file; {_HINT}")
    if error.errno == errno.ENOENT:
        parent = path.parent
        return ConfigError(
            f"the metrics file {path} cannot be created: its directory {parent} does not exist; "
            f"create it first (mkdir -p {shlex.quote(str(parent))})"
        )
    return ConfigError(f"cannot write the metrics file {path}: {error.strerror or error}; {_HINT}")
