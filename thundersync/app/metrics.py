"""`JsonlMetrics`: lifecycle events and per-stage statistics as JSON lines (one object per line).

Every line is a JSON object with a ``type`` (the event's class name, or ``run_started``,
``stage_statistics``, ``run_finished``) and ``t``, the seconds since the sink was opened::

    {"t":0.0,"type":"run_started","file":"examples/pipeline_fake.toml","stages":["source",...]}
    {"t":0.011,"type":"GroupClosed","group_id":0,"num_trajectories":4}
    {"t":0.012,"type":"StepDone","batch_id":0,"policy_version":1,"grad_norm":0.0,"loss":null}
    {"t":0.9,"type":"stage_statistics","name":"reward","state":"done","received":1640,...}
    {"t":0.9,"type":"run_finished","status":"ok","elapsed_s":0.9}

Lines are flushed as they are written, so a crashed run leaves every line up to the crash.
"""

from __future__ import annotations

from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import IO, Any

import msgspec

from thundersync.events import EventBase
from thundersync.pipeline.runner import RunStatistics

__all__ = ["JsonlMetrics"]


class JsonlMetrics:
    """Write metric records to ``path`` (``None``: a sink that drops everything)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self._file: IO[bytes] | None = None
        self._encoder = msgspec.json.Encoder()
        self._start = perf_counter()
        self.lines = 0

    def __enter__(self) -> JsonlMetrics:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("wb")
        self._start = perf_counter()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, type: str, **fields: Any) -> None:
        """Write one record ``{"t": ..., "type": type, **fields}``."""
        if self._file is None:
            return
        record = {"t": round(perf_counter() - self._start, 6), "type": type, **fields}
        self._file.write(self._encoder.encode(record) + b"\n")
        self._file.flush()
        self.lines += 1

    def event(self, event: EventBase) -> None:
        """Write one pipeline event (its fields; ``type`` is its class name)."""
        fields = msgspec.to_builtins(event)
        self.write(fields.pop("type"), **fields)

    def statistics(self, stats: RunStatistics) -> None:
        """Write one ``stage_statistics`` line per stage."""
        for stage in stats.stages.values():
            self.write("stage_statistics", **msgspec.to_builtins(stage))
