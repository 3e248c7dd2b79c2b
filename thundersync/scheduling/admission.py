"""Source admission: bound what a pipeline has in flight, so a long tail cannot exhaust memory.

A group is *in flight* from its admission (before its prompt is submitted) until its release
(when the learner is done with it: its GroupClosed). :class:`Admission` bounds, all optional:

- ``max_groups``: groups in flight;
- ``max_tokens``: tokens in flight: a group's prompt tokens times samples from its admission, and
  every action's and observation's tokens once they exist (:meth:`Admission.reserve_tokens`);
- ``gpu_memory_bytes``: a group is admitted only while the device's allocated memory is under
  this budget (``memory_probe``, default ``torch.cuda.memory_allocated`` of the current device);
- ``sandbox_slots``: trajectories holding a sandbox (:meth:`Admission.hold_sandbox_slot`, from a
  trajectory's first sandbox to its release), or tool calls running at once for runners that keep
  no sandbox per trajectory (:meth:`Admission.sandbox_slot`).

In a pipeline file it is the ``admission`` object (``factory = "admission"``): the source stage
admits each group before it submits the prompt (``tokens``: prompt length times samples), the
generate stage reserves each action's tokens and the tool-execute stage each observation's before
sending them on, and the close stage releases the group, with all its tokens, when it closes.

Progress is guaranteed: the oldest group in flight is never kept waiting for tokens, and a group
is admitted into an empty pipeline whatever its size or the memory reading, so bounds slow a
pipeline down but cannot deadlock it. The price: the oldest group's own reservations may pass
``max_tokens`` (counted as ``forced``), so tokens in flight are at most ``max_tokens`` plus the
oldest group's tokens. Every decision is counted in :meth:`Admission.stats`, which the metrics
sink writes with each step.

    >>> admission = Admission(max_groups=8, max_tokens=65_536)        # doctest: +SKIP
    >>> await admission.admit_group(group_id, tokens=len(prompt) * samples)  # source   # doctest: +SKIP
    >>> await admission.reserve_tokens(group_id, len(tokens))   # generate, tool-execute   # doctest: +SKIP
    >>> admission.release_group(group_id)                            # on GroupClosed     # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
import msgspec

from thundersync.errors import ConfigError

__all__ = ["Admission", "AdmissionStats"]

_Positive = Annotated[int, msgspec.Meta(ge=1)]


class AdmissionStats(msgspec.Struct, kw_only=True):
    """Counters of an :class:`Admission` (a snapshot; the metrics sink writes it per step)."""

    admitted: int = 0
    released: int = 0
    groups_in_flight: int = 0
    tokens_in_flight: int = 0
    peak_groups: int = 0
    peak_tokens: int = 0
    waits: int = 0  # admissions and reservations that had to wait
    waited_s: float = 0.0
    waits_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    forced: int = 0  # admitted over a bound so that the pipeline keeps moving
    sandbox_holders: int = 0  # trajectories holding a sandbox slot now
    peak_sandbox_holders: int = 0


class Admission:
    """Bounds groups, tokens, device memory and sandbox slots in flight; see the module docstring."""

    class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        max_groups: _Positive | None = None
        max_tokens: _Positive | None = None
        gpu_memory_bytes: _Positive | None = None
        sandbox_slots: _Positive | None = None

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        memory_probe: Callable[[], int] | None = None,
        **fields: Any,
    ) -> None:
        if config is not None and fields:
            raise ConfigError(f"give Admission a Config or keyword fields, not both (fields: {sorted(fields)})")
        try:
            self.config = config or msgspec.convert(fields, Admission.Config)
        except msgspec.ValidationError as error:
            raise ConfigError(f"invalid admission settings: {error}") from None
        if self.config.gpu_memory_bytes is not None and memory_probe is None:
            memory_probe = _cuda_memory_allocated
        self._memory_probe = memory_probe
        self._tokens: dict[Hashable, int] = {}  # in flight, oldest first (dicts keep insertion order)
        self._changed = anyio.Event()
        self._slots = None if self.config.sandbox_slots is None else anyio.CapacityLimiter(self.config.sandbox_slots)
        self._holders: set[Hashable] = set()
        self._stats = AdmissionStats()

    # --- the three calls ------------------------------------------------------------------------

    async def admit_group(self, group_id: Hashable, tokens: int = 0) -> None:
        """Wait until a group holding ``tokens`` fits the bounds, then count it in flight."""
        _check_count(tokens, "tokens")
        if group_id in self._tokens:
            raise ConfigError(f"group {group_id!r} is already admitted; release it before admitting it again")
        await self._wait(lambda: self._blocks_group(tokens))
        self._tokens[group_id] = tokens
        self._stats.admitted += 1
        self._update_peaks()

    async def wait_for_room(self, tokens: int = 0) -> None:
        """Wait until a group of ``tokens`` would be admitted, without admitting one (a data-parallel
        source waits for room before it claims a group, so that a busy rank leaves it to others)."""
        _check_count(tokens, "tokens")
        await self._wait(lambda: self._blocks_group(tokens, count_forced=False))

    async def reserve_tokens(self, group_id: Hashable, tokens: int) -> None:
        """Count ``tokens`` more for an admitted group, waiting while that would pass ``max_tokens``
        (the oldest group in flight never waits: it is the one whose release frees the rest)."""
        _check_count(tokens, "tokens")
        if group_id not in self._tokens:
            raise ConfigError(f"group {group_id!r} is not admitted; admit_group() it before reserving tokens")
        await self._wait(lambda: self._blocks_tokens(group_id, tokens))
        self._tokens[group_id] += tokens
        self._update_peaks()

    def release_group(self, group_id: Hashable) -> None:
        """The group's work is done: its tokens and slot are free for others."""
        if self._tokens.pop(group_id, None) is None:
            raise ConfigError(f"group {group_id!r} is not admitted (released twice, or never admitted)")
        self._stats.released += 1
        self._notify()

    @asynccontextmanager
    async def sandbox_slot(self) -> AsyncIterator[None]:
        """Hold one of ``sandbox_slots`` for a tool call (no bound: enter at once)."""
        if self._slots is None:
            yield
            return
        started = time.perf_counter()
        waited = self._slots.available_tokens < 1
        async with self._slots:
            if waited:
                self._count_wait("sandbox_slots", time.perf_counter() - started)
            yield

    async def hold_sandbox_slot(self, holder: Hashable) -> None:
        """Hold one of ``sandbox_slots`` for ``holder`` (a trajectory) until
        :meth:`release_sandbox_slot`, waiting while every slot is held (no bound: at once)."""
        if holder in self._holders:
            raise ConfigError(f"{holder!r} already holds a sandbox slot; release it first")
        if self._slots is not None:
            started = time.perf_counter()
            waited = self._slots.available_tokens < 1
            await self._slots.acquire_on_behalf_of(holder)
            if waited:
                self._count_wait("sandbox_slots", time.perf_counter() - started)
        self._holders.add(holder)
        self._stats.peak_sandbox_holders = max(self._stats.peak_sandbox_holders, len(self._holders))

    def release_sandbox_slot(self, holder: Hashable) -> None:
        """Give back ``holder``'s sandbox slot (nothing when it holds none)."""
        if holder not in self._holders:
            return
        self._holders.discard(holder)
        if self._slots is not None:
            self._slots.release_on_behalf_of(holder)

    def stats(self, *, reset_peaks: bool = False) -> AdmissionStats:
        """A snapshot of the counters; ``reset_peaks`` then starts the peaks again from what is in
        flight now (the metrics report each step's peaks)."""
        snapshot = msgspec.structs.replace(self._stats, waits_by_reason=dict(self._stats.waits_by_reason))
        snapshot.groups_in_flight = len(self._tokens)
        snapshot.tokens_in_flight = sum(self._tokens.values())
        snapshot.sandbox_holders = len(self._holders)
        if reset_peaks:
            self._stats.peak_groups, self._stats.peak_tokens = 0, 0
            self._stats.peak_sandbox_holders = len(self._holders)
            self._update_peaks()
        return snapshot

    # --- decisions ------------------------------------------------------------------------------

    def _blocks_group(self, tokens: int, *, count_forced: bool = True) -> str | None:
        """Why a new group of ``tokens`` must wait (None: admit it)."""
        if not self._tokens:
            if count_forced and self._over_bounds(tokens):
                self._stats.forced += 1  # alone it must run, whatever its size
            return None
        limits = self.config
        if limits.max_groups is not None and len(self._tokens) >= limits.max_groups:
            return "max_groups"
        if limits.max_tokens is not None and sum(self._tokens.values()) + tokens > limits.max_tokens:
            return "max_tokens"
        if self._memory_over_budget():
            return "gpu_memory_bytes"
        return None

    def _blocks_tokens(self, group_id: Hashable, tokens: int) -> str | None:
        limit = self.config.max_tokens
        if limit is None or sum(self._tokens.values()) + tokens <= limit:
            return None
        if next(iter(self._tokens)) == group_id:
            self._stats.forced += 1
            return None
        return "max_tokens"

    def _over_bounds(self, tokens: int) -> bool:
        limit = self.config.max_tokens
        return (limit is not None and tokens > limit) or self._memory_over_budget()

    def _memory_over_budget(self) -> bool:
        budget = self.config.gpu_memory_bytes
        return budget is not None and self._memory_probe is not None and self._memory_probe() > budget

    async def _wait(self, blocked: Callable[[], str | None]) -> None:
        reason = blocked()
        if reason is None:
            return
        first, started = reason, time.perf_counter()
        while reason is not None:
            changed = self._changed
            if reason == "gpu_memory_bytes":  # memory frees without a release: look again soon
                with anyio.move_on_after(0.05):
                    await changed.wait()
            else:
                await changed.wait()
            reason = blocked()
        self._count_wait(first, time.perf_counter() - started)

    def _count_wait(self, reason: str, seconds: float) -> None:
        self._stats.waits += 1
        self._stats.waited_s += seconds
        self._stats.waits_by_reason[reason] = self._stats.waits_by_reason.get(reason, 0) + 1

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _update_peaks(self) -> None:
        self._stats.peak_groups = max(self._stats.peak_groups, len(self._tokens))
        self._stats.peak_tokens = max(self._stats.peak_tokens, sum(self._tokens.values()))


def _check_count(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative int, got {value!r}")


def _cuda_memory_allocated() -> int:
    import torch

    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0
