"""The CUDA stream the engine's jobs run on, and its ordering against the caller's stream.

On CUDA every :class:`~thundersync.engine.run.StreamingRun` launches its jobs on the engine's side
stream of its device (one per device and process, shared by the runs), so the learner's kernels
can run beside a generator's on the default stream. One stream, not one per run: the caching
allocator keeps freed blocks per stream, so a run on a new stream finds none of the blocks its
predecessors cached and takes its memory from ``cudaMalloc`` again, reserving more with every
batch until an allocation fails (bench/RESULTS.md, section "2026-12-02 — Where a streamed OPD
batch's time goes; one engine stream per device; replays without the parameters as inputs
(eleventh session)"). Ordering:

- at each submit, an event is recorded on the caller's current stream, and the job's stream waits
  for it before launching: whatever the caller enqueued before the submit (a job's inputs, the
  optimizer step that last updated the parameters, ``.grad`` set aside by OPD) is done first;
- before the caller reads the job's results (:meth:`JobStream.join`, called after the worker is
  idle), the caller's stream waits for the side stream.

Memory: a tensor the jobs allocate lives in the side stream's pool; one the caller then uses on
its stream and frees (the run's total, a ``.grad`` a job created) is only reused by a later job,
and every job first waits for the caller's stream as of its submit, so the reuse follows the use.
On the CPU every call is a no-op: the ``JobStream`` of a CPU run has no stream.

With ``sms`` (``Acceleration.learner_sms``) the side stream is the learner's stream of a green
context of that many SMs (:func:`thundersync._green.partition`: made by the driver, lowest
priority, kept for the process's life), one per (device, SMs) as the ordinary one is per device;
every warm-up and capture the jobs make then runs on a stream of the same partition
(:func:`thundersync._green.side_stream`), so the engine's graphs keep to its SMs too.

A job's small host inputs go to the device through :func:`thundersync._device.upload`, which does
not wait for the stream's queued work. CUDA-graph captures are :mod:`thundersync.model.graphs`'.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from thundersync import _green

__all__ = ["JobStream"]


class JobStream:
    """The side stream of one run on ``device`` (none on the CPU, or with ``side=False``: the jobs
    then launch on the caller's current stream, as a reference for the side stream's results);
    ``sms`` > 0: the stream of a green context of that many SMs (a ConfigError where the machine
    has none, also on the CPU: the placement is never dropped silently)."""

    def __init__(self, device: torch.device, *, side: bool = True, sms: int = 0) -> None:
        self.device = device
        self.sms = sms
        if sms:
            self.stream: torch.cuda.Stream | None = _green.partition(device, sms).stream
        else:
            self.stream = _side_stream(device) if side and device.type == "cuda" else None

    def mark(self) -> torch.cuda.Event | None:
        """On the caller's thread, at a submit: an event after all the caller's work so far."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def running(self, after: torch.cuda.Event | None) -> Iterator[None]:
        """On the worker: run the block's kernels on the side stream, after the event ``after``."""
        if self.stream is None:
            yield
            return
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """On the caller's thread: its stream waits for every job launched so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The engine's job stream on ``device``, made at the first use and held for good (a stream of
    torch's small pool that no warm-up or capture borrows: :func:`thundersync._green.own_stream`)."""
    key = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    with _streams_lock:
        if key not in _streams:
            _streams[key] = _green.own_stream(key)
        return _streams[key]
