"""CUDA graphs of the model: how every user captures, and the keys under which captures stay valid.

Four users capture a model's work as CUDA graphs: the engine's per-layer and whole-pack graphs,
the teacher's packed scorer and the generator's decode step. They warm up with
:func:`warm_up_stream` (lazy initialisations must not be captured), record with
:func:`capture_graph` (thread-local mode: other threads keep launching) and key their captures by
:class:`ParamsKey` (parameters that moved invalidate them) and by shape buckets
(:func:`power_of_two`).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ParamsKey", "capture_graph", "power_of_two", "warm_up_stream"]


_registrations = itertools.count()  # drawn from by every module's parameter or submodule registration
_registered = 0  # the last number drawn


def _on_registration(*args: object) -> None:
    global _registered
    _registered = next(_registrations)


torch.nn.modules.module.register_module_parameter_registration_hook(_on_registration)
torch.nn.modules.module.register_module_module_registration_hook(_on_registration)


class ParamsKey:
    """``(data pointer, requires_grad)`` of every parameter of a model, the key under which its CUDA
    graphs stay valid. Walking the module tree for it cost 0.46 ms per pack (28 layers); the walk's
    list is kept until any module in the process registers a parameter or a submodule (a
    parameter replaced by assignment, an adapter added: torch's global registration hooks),
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
