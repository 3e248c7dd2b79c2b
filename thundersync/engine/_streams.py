"""The CUDA stream the engine's jobs run on, and its ordering against the caller's stream.

On CUDA every :class:`~thundersync.engine.run.StreamingRun` launches its jobs on the engine's side
stream of its device (one per device and process, shared by the runs), so the learner's kernels
can run beside a generator's on the default stream. One stream, not one per run: the caching
allocator keeps freed blocks per stream, so a run on a new stream finds none of the blocks its
predecessors cached and takes its memory from ``cudaMalloc`` again (measured on the H200: ~2,000
``cudaMalloc`` per OPD batch of a new run, ~30 GB more reserved per batch until an allocation
failed and the allocator released everything; 0.46 s of host time in ``cudaMalloc`` and
``cudaFree`` in the profiled batch that did). Ordering:

- at each submit, an event is recorded on the caller's current stream, and the job's stream waits
  for it before launching: whatever the caller enqueued before the submit (a job's inputs, the
  optimizer step that last updated the parameters, ``.grad`` set aside by OPD) is done first;
- before the caller reads the job's results (:meth:`JobStream.join`, called after the worker is
  idle), the caller's stream waits for the side stream.

Memory: a tensor the jobs allocate lives in the side stream's pool; one the caller then uses on
its stream and frees (the run's total, a ``.grad`` a job created) is only reused by a later job,
and every job first waits for the caller's stream as of its submit, so the reuse follows the use.
On the CPU every call is a no-op: the ``JobStream`` of a CPU run has no stream.

:func:`warm_up_stream` is where every CUDA-graph capture warms up (lazy initialisations must not be
captured), and :func:`capture_graph` where it records. A job's small host inputs go to the device
through :func:`thundersync._device.upload`, which does not wait for the stream's queued work.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["JobStream", "capture_graph", "warm_up_stream"]


class JobStream:
    """The side stream of one run on ``device`` (none on the CPU, or with ``side=False``: the jobs
    then launch on the caller's current stream, as a reference for the side stream's results)."""

    def __init__(self, device: torch.device, *, side: bool = True) -> None:
        self.device = device
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
    """The engine's job stream on ``device``, made at the first use (``torch.cuda.Stream()`` hands
    out the next of a small pool of streams at every call, so a fresh one per run would differ)."""
    key = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    with _streams_lock:
        if key not in _streams:
            _streams[key] = torch.cuda.Stream(key)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
        return _streams[key]


@contextlib.contextmanager
def warm_up_stream() -> Iterator[None]:
    """Run the block on a new CUDA stream after the current one's work; the current stream then
    waits for it, also when the block raises. That matters after a failed warm-up or capture: the
    buffers its kernels read are freed as the error unwinds, and the caching allocator hands their
    memory to the current stream at once, so without the wait a fallback's kernels could overwrite
    indices the side stream's kernels are still reading (measured: a device-side assert in a gather
    after a capture ran out of memory)."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        torch.cuda.current_stream().wait_stream(side)


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, pool: Any = None) -> Iterator[None]:
    """Record the block's CUDA work into ``graph`` (memory from ``pool``), on a capture stream of
    its own, in thread-local mode (other threads keep launching meanwhile: a generator's decode
    steps beside the engine's captures, and the other way round).

    ``torch.cuda.graph`` does the same after a device-wide synchronize, ``empty_cache()`` and the
    pinned host cache's release. Beside a rollout that costs every thread: the synchronize waits
    for every stream, and the released blocks of every stream's pool come back only through
    ``cudaMalloc`` (measured on the H200 after a few captures beside a rollout: 558 calls in 0.6 s,
    100 ms of the engine's host time, stalling the generator's copies behind them). The captured
    work does not run, and the capture stream first waits for the current stream, so whatever the
    block reads was written before it: the synchronize is never needed. The cache is emptied only
    when less than a quarter of the device is free: the capture allocates from its own pool, which
    cannot take the blocks the other pools keep cached, and on the H200 a capture beside 57 GB of
    such blocks ran out of memory.
    """
    free, total = torch.cuda.mem_get_info()
    if free < total // 4:
        torch.cuda.empty_cache()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
