"""One rank's side of the claims: what its source claimed and its close stage sealed, batch by batch.

:class:`GroupClaims` is the protocol through the store; :class:`RankClaims` is the in-process
object that a rank's source and close stages share, so that claims are made when the source
has room and batches are announced when they are sealed on every rank:

- the source calls :meth:`~RankClaims.claim` for the next group of a batch while it has room,
  until it answers None (every group of the batch is claimed, by some rank); then the batch's
  set of local groups is final;
- the close stage calls :meth:`~RankClaims.group_closed` for each local group that closed, and
  iterates :meth:`~RankClaims.sealed` for the :class:`~thundersync.events.BatchReady` of each
  batch, in claim order: it comes once the batch's local groups are closed and every rank has
  closed its own (the store's seal), with this rank's counts. A rank that claimed no group of a
  batch still gets its BatchReady, so that every rank takes part in each step's reduction.

Store calls run in worker threads; waiting for the seal polls the store every ``poll_s``, so it
can be cancelled, and raises :class:`~thundersync.errors.DistributedError` (naming the ranks
that hold unclosed groups) after the claims' ``timeout_s``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.to_thread

from thundersync.errors import ConfigError
from thundersync.events import BatchReady, Id
from thundersync.scheduling.claims import GroupClaims

__all__ = ["RankClaims"]


@dataclass
class _Batch:
    """This rank's share of one batch."""

    batch_id: Id
    groups_in_batch: int
    claimed: list[Id] = field(default_factory=list)
    closed: int = 0
    trajectories: int = 0
    scored_tokens: int = 0
    all_claimed: bool = False
    done: anyio.Event = field(default_factory=anyio.Event)  # all claimed, and the local ones closed

    def update(self) -> None:
        if self.all_claimed and self.closed == len(self.claimed):
            self.done.set()


class RankClaims:
    """The claims of one rank, shared by its source and close stages; see the module docstring."""

    def __init__(self, claims: GroupClaims, *, poll_s: float = 0.05) -> None:
        if not poll_s > 0:
            raise ConfigError(f"poll_s must be positive, got {poll_s!r}")
        self.claims, self.poll_s = claims, poll_s
        self._batches: dict[Id, _Batch] = {}
        self._batch_of: dict[Id, tuple[_Batch, int]] = {}  # local group id -> its batch, its index there
        self._announced: deque[_Batch] = deque()  # fully claimed, not yet sealed, in claim order
        self._ended = False
        self._changed: anyio.Event | None = None  # set when a batch is announced or claims end

    @property
    def rank(self) -> int:
        return self.claims.rank

    async def claim(self, batch_id: Id, group_ids: Sequence[Id]) -> Id | None:
        """Claim the next unclaimed group of ``batch_id`` (whose groups are ``group_ids``, in index
        order); None when every group is claimed, which makes this rank's share of it final."""
        batch = self._batches.get(batch_id)
        if batch is None:
            batch = self._batches[batch_id] = _Batch(batch_id, len(group_ids))
        if batch.all_claimed:
            raise ConfigError(f"batch {batch_id!r} is fully claimed already; claim the next batch")
        index = await anyio.to_thread.run_sync(self.claims.claim, batch_id, len(group_ids))
        if index is None:
            batch.all_claimed = True
            batch.update()
            self._announced.append(batch)
            self._notify()
            return None
        group_id = group_ids[index]
        batch.claimed.append(group_id)
        self._batch_of[group_id] = batch, index
        return group_id

    def end(self) -> None:
        """No more batches (the source is done): :meth:`sealed` ends after the announced ones."""
        self._ended = True
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def group_closed(self, group_id: Id, *, trajectories: int, scored_tokens: int) -> None:
        """A local group closed (its GroupClosed was sent): count it, and close it in the store."""
        found = self._batch_of.pop(group_id, None)
        if found is None:
            raise ConfigError(
                f"rank {self.rank} closed group {group_id!r}, which it never claimed; with data-parallel "
                "claims, only the source's claimed groups may enter the pipeline"
            )
        batch, index = found
        await anyio.to_thread.run_sync(self.claims.close, batch.batch_id, index, batch.groups_in_batch)
        batch.closed += 1
        batch.trajectories += trajectories
        batch.scored_tokens += scored_tokens
        batch.update()

    async def sealed(self) -> AsyncGenerator[BatchReady, None]:
        """Each announced batch's BatchReady (this rank's counts), once it is sealed on every rank."""
        while self._announced or not self._ended:
            if not self._announced:
                self._changed = anyio.Event()
                await self._changed.wait()
                continue
            batch = self._announced.popleft()
            await batch.done.wait()
            await self._wait_sealed(batch.batch_id)
            yield BatchReady(
                batch_id=batch.batch_id,
                num_groups=len(batch.claimed),
                num_trajectories=batch.trajectories,
                num_scored_tokens=batch.scored_tokens,
            )
            del self._batches[batch.batch_id]
            await anyio.to_thread.run_sync(self.claims.finish, batch.batch_id)

    async def _wait_sealed(self, batch_id: Id) -> None:
        with anyio.move_on_after(self.claims.timeout_s) as scope:
            # the store cannot notify a coroutine; polling it keeps the wait cancellable
            while not await anyio.to_thread.run_sync(self.claims.is_sealed, batch_id):  # noqa: ASYNC110
                await anyio.sleep(self.poll_s)
        if scope.cancelled_caught:
            raise await anyio.to_thread.run_sync(self.claims.not_sealed, batch_id)
