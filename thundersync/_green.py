"""CUDA green contexts: the learner's streams on a partition of a device's SMs (private).

``Acceleration.learner_sms = N`` puts the engine's work on N SMs of its device, so that the
generator's decode keeps the others. :func:`partition` asks the driver (NVIDIA's ``cuda.bindings``)
to split the device's SMs into N and the rest, makes a green context of the N, and creates the
learner's stream inside it with ``cuGreenCtxStreamCreate`` at CUDA's lowest priority; torch sees an
ordinary external stream, so launches, events and the caching allocator work on it as on any
other. A kernel keeps to the partition only when it is launched on a stream of the partition, and a
CUDA graph only when it was *captured* on one (replayed there, a graph captured on an ordinary
stream ran at the whole GPU's speed: bench/RESULTS.md, section "2026-12-05 — The engine
restructure, before and after; green contexts probed"). So :func:`side_stream`, the stream that
:mod:`thundersync.model.graphs` warms up and captures on, is a stream of the same partition when
the current stream is one (thread-local capture mode, which the probe found to work beside other
threads' launches), and an ordinary stream otherwise.

Streams are never shared by accident. ``torch.cuda.Stream()`` hands out the next of a pool of 32
streams per priority, so two draws 32 apart are the same stream: a generator's decode graph
captured on the engine's job stream failed the engine's next host-to-device copy ("Cannot copy
between CPU and CUDA tensors during CUDA graph capture"), and could as well have recorded the
engine's kernels into the generator's graph. So every stream of the process's long-lived users is
drawn with :func:`own_stream` (the engine's job stream, the generator's decode stream), every
warm-up and capture borrows its :func:`side_stream` for the block only, and no draw returns a
stream that another holds.

Lifetime: partitions, their contexts and streams are made once per (device, SMs) and kept until
the process ends; nothing destroys them. Destroying a green context while a tensor used on its
streams is alive aborts the process when that tensor is freed (seen in the probe), while a process
that exits with its partitions alive exits cleanly (exit 0 in the probe).

On Hopper the driver splits SMs in groups of 8, so ``N`` must be a multiple of 8 (checked for every
device, so that a file valid on one GPU is valid on another) and leave at least 8 SMs to the rest.
What is missing for a partition (no CUDA device, no ``cuda.bindings``, an older driver) is an error
that names it: there is no silent fallback to the whole device.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from thundersync.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "SM_GROUP",
    "Partition",
    "check_sms",
    "decode_stream",
    "missing",
    "own_stream",
    "partition",
    "partition_of",
    "side_stream",
]

SM_GROUP = 8
"""The driver's granularity of an SM split on Hopper: a partition is a multiple of it."""

_DRAWS = 96  # torch's pool keeps 32 streams per priority: three rounds find one that nobody holds
_MIN_DRIVER = 12050  # cuGreenCtxStreamCreate: CUDA 12.5


def check_sms(value: object, where: str) -> None:
    """``value`` is 0 (no partition) or a positive multiple of :data:`SM_GROUP`; else a
    ConfigError naming ``where`` and the value."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0 and value % SM_GROUP == 0
    if not ok:
        raise ConfigError(
            f"{where} must be 0 (the learner shares every SM) or a positive multiple of {SM_GROUP} "
            f"(the driver splits a Hopper GPU's SMs in groups of {SM_GROUP}), got {value!r}"
        )


@dataclass(eq=False)
class Partition:
    """``sms`` SMs of ``device`` as a green context (``rest_sms`` left to everything else), with
    its ``stream`` and, made on demand, companion streams for warm-ups and captures, all at
    ``priority`` (the learner's: CUDA's lowest; the complement's: the highest)."""

    device: torch.device
    sms: int
    rest_sms: int
    stream: torch.cuda.Stream
    _context: Any
    priority: int
    _rest: Any = None  # the driver's resource of the other SMs (the learner's partition only)
    _complement: Partition | None = None
    _companions: list[torch.cuda.Stream] = field(default_factory=list)

    def companion(self) -> torch.cuda.Stream:
        """A stream of this partition other than :attr:`stream` that nobody holds, now held (until
        :func:`side_stream`'s block ends); made when every one is held."""
        with _lock:
            for stream in self._companions:
                if stream.cuda_stream not in _held:
                    _held.add(stream.cuda_stream)
                    return stream
            stream = _new_stream(self._context, self.device, self.priority)
            self._companions.append(stream)
            _held.add(stream.cuda_stream)
            _by_stream[stream.cuda_stream] = self
            return stream

    def complement(self) -> Partition:
        """The other SMs of the device (``rest_sms``) as a green context of their own, made at the
        first call and kept, its streams at CUDA's highest priority: the decode's, so that the
        learner's partition and the decode never share an SM (:func:`decode_stream`)."""
        with _lock:
            if self._complement is None:
                if self._rest is None:
                    raise ValueError(f"the partition of {self.sms} SMs is itself a complement")
                from cuda.bindings import driver

                context = _context_of(self._rest, self.device)
                _, highest = _driver(driver.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
                stream = _new_stream(context, self.device, highest)
                made = Partition(self.device, self.rest_sms, self.sms, stream, context, highest)
                _by_stream[made.stream.cuda_stream] = made
                self._complement = made
            return self._complement


_lock = threading.Lock()
_partitions: dict[tuple[int, int], Partition] = {}  # (device index, SMs) -> kept for the process's life
_by_stream: dict[int, Partition] = {}  # every partition stream's handle -> its partition
# handles of the streams someone holds: own_stream()'s while its owner lives, side_stream()'s for a block
_held: set[int] = set()


def own_stream(device: torch.device | None = None, priority: int = 0, *, owner: object = None) -> torch.cuda.Stream:
    """A stream of torch's pool (``device``, ``priority``) that nobody else holds, held while
    ``owner`` lives (for the process's life without one): a long-lived user's stream (module
    docstring). The hold follows the owner, never the stream object: torch's CUDA stream objects
    take weak references but never clear them when freed, so a finalizer on one never runs, and
    the interpreter crashed at exit touching it."""
    import torch

    stream = _take_free(lambda: torch.cuda.Stream(device, priority=priority))  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    _hold_for(owner, stream)
    return stream


def decode_stream(device: torch.device, learner_sms: int, *, owner: object) -> torch.cuda.Stream:
    """A stream of the SMs that the learner's partition of ``learner_sms`` leaves on ``device``
    (:meth:`Partition.complement`, highest priority), held while ``owner`` lives: the decode's,
    so that its kernels and the graphs captured under it never run on the learner's SMs."""
    stream = partition(device, learner_sms).complement().companion()
    _hold_for(owner, stream)
    return stream


def _hold_for(owner: object, stream: torch.cuda.Stream) -> None:
    if owner is not None:
        weakref.finalize(owner, _unhold, stream.cuda_stream)


def _take_free(draw: Callable[[], torch.cuda.Stream]) -> torch.cuda.Stream:
    """The first stream ``draw`` gives that nobody holds, now held (a RuntimeError after
    :data:`_DRAWS` draws: every stream of the pool is held)."""
    for _ in range(_DRAWS):
        stream = draw()
        with _lock:
            if stream.cuda_stream not in _held:
                _held.add(stream.cuda_stream)
                return stream
    raise RuntimeError(f"no free CUDA stream after {_DRAWS} draws from torch's pool: every one is held")


def _unhold(handle: int) -> None:
    with _lock:
        _held.discard(handle)


@contextlib.contextmanager
def side_stream() -> Iterator[torch.cuda.Stream]:
    """A stream for one warm-up or capture, held for the block: a companion of the current
    stream's partition (so a graph keeps to the partition's SMs), else an ordinary stream of
    torch's pool, never one that another user holds meanwhile."""
    import torch

    current = partition_of(torch.cuda.current_stream())
    stream = current.companion() if current is not None else _take_free(torch.cuda.Stream)
    try:
        yield stream
    finally:
        _unhold(stream.cuda_stream)


def missing(device: torch.device) -> str | None:
    """What this machine lacks for a partition of ``device``'s SMs (None: nothing)."""
    import torch

    if device.type != "cuda":
        return f"the learner's parameters are on {device}, and only a CUDA device's SMs can be partitioned"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if torch.version.hip is not None:
        return f"green contexts are NVIDIA's, and this torch is built for ROCm {torch.version.hip}"
    try:
        from cuda.bindings import driver
    except ImportError as error:
        return (
            f"the driver API's Python bindings, which make the partition, do not import ({error}); install "
            "NVIDIA's cuda-bindings for the machine's CUDA (pip install cuda-bindings)"
        )
    if not hasattr(driver, "cuGreenCtxStreamCreate"):
        return "this cuda-bindings has no cuGreenCtxStreamCreate; install cuda-bindings 12.5 or later"
    status, version = driver.cuDriverGetVersion()
    if status != driver.CUresult.CUDA_SUCCESS or version < _MIN_DRIVER:
        return f"green-context streams need a CUDA driver of 12.5 or later; this one reports {version}"
    return None


def partition(device: torch.device, sms: int) -> Partition:
    """The partition of ``sms`` SMs of ``device``, made at the first call and kept (module docstring)."""
    import torch

    check_sms(sms, "learner_sms")
    lacking = missing(device)
    if lacking is not None:
        raise ConfigError(f"learner_sms = {sms} needs a CUDA green context, but {lacking}; or set learner_sms = 0")
    index = torch.cuda.current_device() if device.index is None else device.index
    with _lock:
        made = _partitions.get((index, sms))
        if made is None:
            made = _partitions[(index, sms)] = _make(torch.device("cuda", index), sms)
            _by_stream[made.stream.cuda_stream] = made
        return made


def partition_of(stream: torch.cuda.Stream) -> Partition | None:
    """The partition whose stream ``stream`` is (None: an ordinary stream)."""
    return _by_stream.get(stream.cuda_stream) if _by_stream else None


def _driver(result: tuple[Any, ...], what: str) -> Any:
    """The values of a driver call's ``result``; a ConfigError naming ``what`` and the CUDA error."""
    from cuda.bindings import driver

    error, *values = result
    if error != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(error)
        text = name.decode() if isinstance(name, bytes) else str(name)
        raise ConfigError(f"making the learner's green context failed at {what}: {text}")
    return values[0] if len(values) == 1 else tuple(values)


def _make(device: torch.device, sms: int) -> Partition:
    import torch
    from cuda.bindings import driver

    index = device.index or 0
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if sms > total - SM_GROUP:
        raise ConfigError(
            f"learner_sms = {sms} leaves the rest of {device} ({total} SMs) fewer than {SM_GROUP} SMs; "
            f"give at most {(total - SM_GROUP) // SM_GROUP * SM_GROUP}"
        )
    torch.zeros(1, device=device)  # the primary context exists and is current
    dev = _driver(driver.cuDeviceGet(index), "cuDeviceGet")
    whole = _driver(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM), "SMs")
    groups, _, rest = _driver(driver.cuDevSmResourceSplitByCount(1, whole, 0, sms), "the SM split")
    got = int(groups[0].sm.smCount)
    if got != sms:
        raise ConfigError(f"learner_sms = {sms}: the driver split {got} SMs on {device}; give a multiple of its group")
    context = _context_of(groups[0], device)
    lowest, _ = _driver(driver.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
    return Partition(device, sms, int(rest.sm.smCount), _new_stream(context, device, lowest), context, lowest, rest)


def _context_of(resource: Any, device: torch.device) -> Any:
    """A green context of the driver's SM ``resource`` on ``device``."""
    from cuda.bindings import driver

    dev = _driver(driver.cuDeviceGet(device.index or 0), "cuDeviceGet")
    desc = _driver(driver.cuDevResourceGenerateDesc([resource], 1), "the resource descriptor")
    flags = driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
    return _driver(driver.cuGreenCtxCreate(desc, dev, flags), "cuGreenCtxCreate")


def _new_stream(context: Any, device: torch.device, priority: int) -> torch.cuda.Stream:
    """A non-blocking stream of the green context ``context`` at ``priority``."""
    import torch
    from cuda.bindings import driver

    flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
    raw = _driver(driver.cuGreenCtxStreamCreate(context, flags, priority), "cuGreenCtxStreamCreate")
    return torch.cuda.get_stream_from_external(int(raw), device)
