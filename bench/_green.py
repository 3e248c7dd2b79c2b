"""CUDA green contexts for the benchmarks: a stream whose kernels run on a fixed share of the SMs.

The stream is created by the driver inside the green context (``cuGreenCtxStreamCreate`` through
``cuda.bindings``), not by making the context current and asking torch for a stream: torch then
sees an ordinary external stream and every capture, replay and allocation goes through it as on
any other stream. The contexts live until the process ends, unless :func:`release` is asked to destroy them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GreenPartition", "green_partition", "release"]


@dataclass
class GreenPartition:
    """``sms`` SMs of a device as a green context with one stream, and the rest (``rest_sms``) as
    another, with its own stream, for the work that must stay off the first partition."""

    sms: int
    rest_sms: int
    stream: torch.cuda.Stream
    rest_stream: torch.cuda.Stream
    _handles: list[Any]


_made: list[GreenPartition] = []
_lock = threading.Lock()


def _check(result: tuple[Any, ...]) -> Any:
    from cuda.bindings import driver

    error, *values = result
    if error != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(error)
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else tuple(values)


def green_partition(sms: int, device: torch.device | None = None, *, priority: int = 0) -> GreenPartition:
    """Split ``device``'s SMs into ``sms`` (rounded up by the driver to its granularity: 8 on
    Hopper) and the rest, each a green context with one non-blocking stream of ``priority`` (0 is
    CUDA's lowest; the rest's stream gets the highest)."""
    from cuda.bindings import driver

    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    torch.zeros(1, device=f"cuda:{index}")  # the primary context exists and is current
    dev = _check(driver.cuDeviceGet(index))
    whole = _check(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _, rest = _check(driver.cuDevSmResourceSplitByCount(1, whole, 0, sms))
    _, greatest = _check(driver.cuCtxGetStreamPriorityRange())
    streams, handles = [], []
    for resource, stream_priority in ((groups[0], priority), (rest, greatest)):
        desc = _check(driver.cuDevResourceGenerateDesc([resource], 1))
        context = _check(driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        raw = _check(
            driver.cuGreenCtxStreamCreate(context, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, stream_priority)
        )
        handles += [raw, context]
        streams.append(torch.cuda.get_stream_from_external(int(raw), torch.device("cuda", index)))
    partition = GreenPartition(groups[0].sm.smCount, rest.sm.smCount, streams[0], streams[1], handles)
    with _lock:
        _made.append(partition)
    return partition


def release(*, destroy: bool = False) -> None:
    """Synchronize the device; with ``destroy``, also destroy every partition's streams and
    contexts, which is safe only once no tensor used on their streams is alive (a tensor freed
    later records an event on a destroyed stream: the process aborts)."""
    from cuda.bindings import driver

    with _lock:
        torch.cuda.synchronize()
        if not destroy or not _made:
            return
        torch.cuda.empty_cache()
        for partition in _made:
            for handle in partition._handles:
                if isinstance(handle, driver.CUstream):
                    _check(driver.cuStreamDestroy(handle))
                else:
                    _check(driver.cuGreenCtxDestroy(handle))
        _made.clear()
