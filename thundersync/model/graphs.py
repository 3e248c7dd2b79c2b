"""CUDA graphs of the model: one owner for every cache of captures, and how each capture is made.

Four users capture a model's work as CUDA graphs: the engine's per-layer and whole-pack graphs,
the teacher's packed scorer and the generator's decode step. Each states only what it captures
for a key (a shape bucket); a :class:`GraphCache` owns the rest: the entries, their memory pool,
invalidation when the parameters move (:class:`ParamsKey`), one user of the static buffers at a
time, what a failed capture does, the counts, and the bound on the memory that every pool of the
process holds together (past it, a cache drops its captures before it captures again). Captures
warm up with :func:`warm_up_stream` and record with :func:`capture_graph` (thread-local mode:
other threads keep launching meanwhile), both on :func:`thundersync._green.side_stream`: a stream of
the current stream's green context where it has one (a graph keeps to a partition's SMs only when
captured on its stream), else an ordinary stream, held for the block so that no other thread
launches on it meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

import torch

from thundersync import _green
from thundersync._logging import get_logger

__all__ = ["GraphCache", "ParamsKey", "capture_graph", "graph_pool_bytes", "power_of_two", "warm_up_stream"]

_log = get_logger(__name__)

K = TypeVar("K", bound=Hashable)
E = TypeVar("E")


_registrations = itertools.count()  # drawn from by every module's parameter or submodule registration
_registered = 0  # the last number drawn


def _on_registration(*args: object) -> None:
    global _registered
    _registered = next(_registrations)


torch.nn.modules.module.register_module_parameter_registration_hook(_on_registration)
torch.nn.modules.module.register_module_module_registration_hook(_on_registration)


class ParamsKey:
    """``(data pointer, requires_grad)`` of every parameter of a model, the key under which its CUDA
    graphs stay valid. Walking the module tree for it at every pack costs host time
    (bench/RESULTS.md, section "2026-12-02 — Where a streamed pack's time goes beside a rollout;
    captures that stall every thread; the compiled math in the pack graphs (tenth session)"), so
    the walk's list is kept until any module in the process registers a parameter or a submodule
    (a parameter replaced by assignment, an adapter added: torch's global registration hooks),
    while pointers and flags are read on every call (``.data`` swapped, a parameter frozen)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)
        self._seen = -1
        self._params: list[torch.nn.Parameter] = []

    def __call__(self) -> tuple[tuple[int, bool], ...]:
        model = self._model()
        if model is None:
            return ()
        if self._seen != _registered:
            self._seen = _registered  # read first: a registration during the walk walks again next time
            self._params = list(model.parameters())
        return tuple((p.data_ptr(), p.requires_grad) for p in self._params)


def power_of_two(n: int, low: int) -> int:
    """The smallest power of two that is at least ``n`` and ``low``."""
    return max(low, 1 << max(n - 1, 0).bit_length())


@contextlib.contextmanager
def warm_up_stream() -> Iterator[None]:
    """Run the block on a new CUDA stream after the current one's work; the current stream then
    waits for it, also when the block raises. That matters after a failed warm-up or capture: the
    buffers its kernels read are freed as the error unwinds, and the caching allocator hands their
    memory to the current stream at once, so without the wait a fallback's kernels could overwrite
    indices the side stream's kernels are still reading (seen: a device-side assert in a gather
    after a capture ran out of memory; bench/RESULTS.md, section "2026-12-02 — The host-time changes
    measured, and the sampler in two kernels (ninth session): batch-1 step 1.30 ms, long tail
    4.92 s")."""
    with _green.side_stream() as side:
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
    ``cudaMalloc``, which stalls the generator's copies behind them (bench/RESULTS.md, section
    "2026-12-02 — Where a streamed pack's time goes beside a rollout; captures that stall every
    thread; the compiled math in the pack graphs (tenth session)"). The captured work does not
    run, and the capture stream first waits for the current stream, so whatever the block reads
    was written before it: the synchronize is never needed. The cache is emptied only
    when less than a quarter of the device is free: the capture allocates from its own pool, which
    cannot take the blocks the other pools keep cached, and a capture beside many such blocks ran
    out of memory (same section).
    """
    free, total = torch.cuda.mem_get_info()
    if free < total // 4:
        torch.cuda.empty_cache()
    with _green.side_stream() as stream:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                yield
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)


class GraphCache(Generic[K, E]):
    """The captures of one user over one model, by key, in one memory pool.

    ``get(key, capture)`` returns the entry for ``key``, made by ``capture(pool)`` on first use
    (``capture`` warms up and records into ``pool``; the entry holds its graphs and static
    buffers). Before a new capture: parameters that moved since the last one (``model``'s
    :class:`ParamsKey`) drop every entry and call ``on_reset``; so does a process whose graph pools
    together hold more than ``pool_fraction`` of the device's memory (counted ``evicted``; the
    freed pool's memory goes back to the device). A capture that raises turns the cache off when
    ``fail_off`` (logged once, counted ``capture_failed``; ``get`` then returns None and the
    user runs eagerly), else the error propagates. ``acquire``/``release`` give the static
    buffers to one user at a time. ``counts`` (also added, under ``prefix``, to ``shared``)
    says what happened: ``captured``, ``evicted``, ``capture_failed`` and whatever the user counts.
    """

    def __init__(
        self,
        name: str,
        model: torch.nn.Module | None = None,
        *,
        pool_fraction: float = 1.0,
        fail_off: bool = False,
        on_reset: Callable[[], None] | None = None,
        shared: collections.Counter[str] | None = None,
        prefix: str = "",
    ) -> None:
        self.name, self.pool_fraction, self.fail_off = name, pool_fraction, fail_off
        # weakly: an owner whose method this is (PackGraphs) then dies by reference counting, with
        # its pool, as soon as its model does, not at the next garbage collection
        self._on_reset = weakref.WeakMethod(on_reset) if inspect.ismethod(on_reset) else on_reset
        self._params = ParamsKey(model) if model is not None else None
        self._key: tuple[tuple[int, bool], ...] | None = None
        self.entries: dict[K, E] = {}
        self.pool: Any = None
        self.failed = False
        self.busy = False
        self.counts: collections.Counter[str] = collections.Counter()
        self._shared, self._prefix = shared, prefix

    def count(self, what: str) -> None:
        self.counts[what] += 1
        if self._shared is not None:
            self._shared[self._prefix + what] += 1

    def current(self) -> bool:
        """Whether the entries are valid for the parameters as they are now; drops them (and calls
        ``on_reset``) where they are not. Call it before using an entry."""
        key = self._params() if self._params is not None else ()
        if self._key is not None and key == self._key:
            return True
        self._reset(key)
        return False

    def get(self, key: K, capture: Callable[[Any], E]) -> E | None:
        """The entry for ``key``, captured now if new (None: the cache is off)."""
        if self.failed:
            return None
        self.current()
        entry = self.entries.get(key)
        if entry is not None:
            return entry
        if self.entries and _over(self.pool_fraction):
            self.count("evicted")
            _log.info("graph_cache_evicted", cache=self.name, entries=len(self.entries))
            self._reset(self._key)
            torch.cuda.empty_cache()
        try:
            entry = capture(self.pool)
        except Exception as error:
            if not self.fail_off:
                raise
            self.failed = True
            self.count("capture_failed")
            _log.warning("graph_capture_failed", cache=self.name, key=repr(key), error=repr(error), fallback="eager")
            return None
        self.entries[key] = entry
        self.count("captured")
        return entry

    def acquire(self) -> bool:
        """Take the static buffers (False: another user's backward or result is pending)."""
        if self.busy:
            return False
        self.busy = True
        return True

    def release(self) -> None:
        """The user that :meth:`acquire` served is done with the static buffers."""
        self.busy = False

    def clear(self) -> None:
        """Drop every entry (their memory goes back once nothing else holds it)."""
        self._reset(None)

    def _reset(self, key: tuple[tuple[int, bool], ...] | None) -> None:
        self.entries, self.pool, self._key = {}, torch.cuda.graph_pool_handle(), key
        on_reset = self._on_reset() if isinstance(self._on_reset, weakref.WeakMethod) else self._on_reset
        if on_reset is not None:
            on_reset()


_snapshot_lock = threading.Lock()


def graph_pool_bytes() -> int:
    """Bytes the process's CUDA-graph memory pools hold on the current device (every segment of a
    private pool; a memory snapshot, taken only before a capture)."""
    with _snapshot_lock:
        segments = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]  # untyped in torch
    device = torch.cuda.current_device()
    return sum(
        int(s["total_size"])
        for s in segments
        if s.get("device", device) == device and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)
    )


def _over(fraction: float) -> bool:
    """Whether the process's graph pools hold more than ``fraction`` of the device's memory."""
    if fraction >= 1.0 or not torch.cuda.is_available():
        return False
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return graph_pool_bytes() > fraction * total
