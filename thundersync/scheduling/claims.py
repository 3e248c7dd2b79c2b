"""Cross-rank work claims: data-parallel ranks share one logical batch group by group.

Every rank sees the same batch (``groups_in_batch`` prompt groups, indexed 0..n-1). Instead of a
fixed split, a rank *claims* the next unclaimed group whenever it has room for one, through an
atomic counter in the ``torch.distributed`` store. A rank whose trajectories are short finishes
early and claims more; none idles while a group is unclaimed. A group is claimed exactly once
(the counter is atomic), and the batch is *sealed* when every group of it has closed on some rank:
the rank that closes the last one writes the seal, and every rank waits for it before the
gradient reduction.

Store keys live under ``{prefix}/{batch_id}/``: ``next`` (claim counter), ``closed`` (close
counter), ``owner/{index}`` (the rank that claimed a group, until it closes), ``sealed`` (written
once) and ``done`` (ranks finished with the batch). The last rank to call
:meth:`GroupClaims.finish` deletes the batch's keys, so nothing is left in the store. A batch that
is not sealed in time raises :class:`~thundersync.errors.DistributedError` naming the ranks that
hold unclosed groups and any cause a failed rank reported.

    >>> claims = GroupClaims(store, rank=rank, world_size=world)              # doctest: +SKIP
    >>> while (index := claims.claim(batch_id, groups_in_batch)) is not None:  # doctest: +SKIP
    ...     process(index); claims.close(batch_id, index, groups_in_batch)     # doctest: +SKIP
    >>> claims.wait_sealed(batch_id); claims.finish(batch_id)                 # doctest: +SKIP

Store calls block; from async code run them in a worker thread (``anyio.to_thread.run_sync``).
"""

from __future__ import annotations

import datetime
from collections.abc import Hashable
from typing import Any

from thundersync.errors import ConfigError, DistributedError

__all__ = ["GroupClaims"]


class GroupClaims:
    """Claims of prompt groups by ranks through ``store`` (a ``torch.distributed.Store``)."""

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        world_size: int,
        prefix: str = "thundersync/claims",
        timeout_s: float = 300.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside 0..{world_size - 1} (world_size {world_size})")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix, self.timeout_s = prefix.rstrip("/"), timeout_s
        self.claimed: dict[Hashable, list[int]] = {}  # batch -> the groups this rank claimed

    def claim(self, batch_id: Hashable, groups_in_batch: int) -> int | None:
        """The index of a group of ``batch_id`` that no rank has claimed, now this rank's; None
        when every group is claimed."""
        if groups_in_batch < 1:
            raise ConfigError(f"groups_in_batch must be >= 1, got {groups_in_batch}")
        index = int(self.store.add(self._key(batch_id, "next"), 1)) - 1
        if index >= groups_in_batch:
            return None
        self.store.set(self._key(batch_id, f"owner/{index}"), str(self.rank))
        self.claimed.setdefault(batch_id, []).append(index)
        return index

    def close(self, batch_id: Hashable, index: int, groups_in_batch: int) -> bool:
        """Group ``index`` of the batch is closed; the rank closing the last one seals it (True)."""
        if index not in self.claimed.get(batch_id, []):
            raise ConfigError(f"rank {self.rank} closes group {index} of batch {batch_id!r}, which it never claimed")
        self.store.delete_key(self._key(batch_id, f"owner/{index}"))
        closed = int(self.store.add(self._key(batch_id, "closed"), 1))
        if closed > groups_in_batch:
            raise DistributedError(
                f"batch {batch_id!r} has {groups_in_batch} groups but {closed} closes were counted; "
                "each claimed group must be closed once"
            )
        if closed == groups_in_batch:
            self.store.set(self._key(batch_id, "sealed"), b"1")
            return True
        return False

    def wait_sealed(self, batch_id: Hashable) -> None:
        """Block until every group of the batch has closed on some rank (or raise after the timeout)."""
        key = self._key(batch_id, "sealed")
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        except Exception as error:  # the store raises its own DistStoreError/RuntimeError on timeout
            raise self.not_sealed(batch_id) from error

    def is_sealed(self, batch_id: Hashable) -> bool:
        """Whether every group of the batch has closed on some rank (one store call, no wait)."""
        return bool(self.store.check([self._key(batch_id, "sealed")]))

    def not_sealed(self, batch_id: Hashable) -> DistributedError:
        """The error of a batch not sealed within the timeout: who holds its unclosed groups, and why
        any rank that reported a failure stopped."""
        from thundersync.engine.failures import TIMEOUT_HINT, describe_failures  # loads torch: only now

        return DistributedError(
            f"rank {self.rank}: batch {batch_id!r} was not sealed within {self.timeout_s:g} s: "
            f"{self._holders(batch_id)}{describe_failures(self.store, self.world_size, me=self.rank)}; {TIMEOUT_HINT}"
        )

    def finish(self, batch_id: Hashable) -> None:
        """This rank is done with the batch; the last rank to finish deletes its keys."""
        self.claimed.pop(batch_id, None)
        if int(self.store.add(self._key(batch_id, "done"), 1)) == self.world_size:
            for name in ("next", "closed", "sealed", "done"):
                self.store.delete_key(self._key(batch_id, name))

    def _holders(self, batch_id: Hashable) -> str:
        """Which ranks hold claimed groups that never closed (owner keys are deleted at close)."""
        claimed = min(self._count(batch_id, "next"), 1 << 20)
        closed = self._count(batch_id, "closed")
        holders: dict[str, list[int]] = {}
        for index in range(claimed):
            key = self._key(batch_id, f"owner/{index}")
            if self.store.check([key]):
                holders.setdefault(self.store.get(key).decode(), []).append(index)
        held = "; ".join(
            f"rank {rank} holds unclosed groups {indices}{_where(self.store, int(rank))}"
            for rank, indices in sorted(holders.items())
        )
        return f"{closed} groups closed" + (f"; {held}" if held else "")

    def _count(self, batch_id: Hashable, name: str) -> int:
        return int(self.store.add(self._key(batch_id, name), 0))

    def _key(self, batch_id: Hashable, name: str) -> str:
        return f"{self.prefix}/{batch_id}/{name}"


def _where(store: Any, rank: int) -> str:
    from thundersync.engine.failures import whereabouts

    where = whereabouts(store, rank)
    return f" ({where})" if where else ""
