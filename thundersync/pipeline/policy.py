"""`PolicyClock`: the published policy version, shared by step (publishes) and generate (waits).

A graph is acyclic, so the step -> generate feedback of ARCHITECTURE.md ("generate may start
batch ``n`` only once the learner is close enough to it") travels through this runtime object,
not an edge::

    clock = PolicyClock(max_staleness=0)
    graph.add("generate", GenerateStage(cfg, generator=g, policy=clock), reads=["source"])
    graph.add("backward", BackwardStage(objective=o, policy=clock), reads=["generate", "reward"])
    graph.add("step", StepStage(policy=clock), reads=["close"])

One rule maps batches to versions (:class:`BatchVersions`): the ``n``-th batch a run starts
(0-based, in its source's order) is stepped by the run's ``n``-th step, on the learner's version
``base + n`` (``base``: the clock's version when the run started), and that step publishes
``base + n + 1``. The step stage calls :meth:`PolicyClock.publish` after the optimizer step
completed; the rollout stages call :meth:`PolicyClock.wait_to_start` before they start batch
``n``: it returns once the live version is at least ``base + n - max_staleness``. With
``max_staleness = 0`` (the default) that is version ``base + n`` itself: zero staleness. With
``k >= 1`` generation runs up to ``k`` versions ahead of the learner, and the backward stage holds
the events of a batch whose version is not live yet (decision 073).
"""

from __future__ import annotations

from typing import Annotated

import anyio
import msgspec

from thundersync.errors import ConfigError
from thundersync.events import Id

__all__ = ["BatchVersions", "PolicyClock"]


class PolicyClock:
    """A monotonically increasing policy version that tasks can wait on.

    ``max_staleness`` (:class:`PolicyClock.Config`, default 0): how many versions the policy that
    samples a batch may lag behind the version the learner steps that batch on.
    """

    class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        """The clock's options: ``max_staleness`` = k; batch ``n`` may start on any version >= n - k."""

        max_staleness: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __init__(self, version: int = 0, *, max_staleness: int = Config().max_staleness) -> None:
        if version < 0:
            raise ConfigError(f"a policy version must be >= 0, got {version}")
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ConfigError(
                f"max_staleness must be an integer >= 0 (0: each batch starts on the version it is stepped on), "
                f"got {max_staleness!r}"
            )
        self.version = version
        self.max_staleness = max_staleness
        self._changed: anyio.Event | None = None  # created on first wait (needs an event loop)

    def publish(self, version: int) -> None:
        """Make ``version`` the live policy and wake every waiter; versions only increase."""
        if version <= self.version:
            raise ConfigError(
                f"policy version {version} was published after version {self.version}; versions must increase"
            )
        self.version = version
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_for(self, version: int) -> int:
        """Return once the live version is at least ``version``; returns the live version."""
        while self.version < version:
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()
        return self.version

    async def wait_to_start(self, version: int) -> int:
        """Return once a batch the learner steps on ``version`` may start generating: the live
        version is at least ``version - max_staleness``; returns the live version."""
        return await self.wait_for(version - self.max_staleness)

    def is_live(self, version: int) -> bool:
        """Whether the learner is at ``version`` or later (a batch of that version may go in)."""
        return self.version >= version

    def __repr__(self) -> str:
        staleness = f", max_staleness={self.max_staleness}" if self.max_staleness else ""
        return f"PolicyClock(version={self.version}{staleness})"


class BatchVersions:
    """The learner version each batch of a run is stepped on: ``base + n`` for the ``n``-th
    distinct batch id (0-based, in the order this counter first sees them).

    Every stage that needs the rule keeps one (generate and agent-app count the batches they
    start, the backward stage the batches whose groups it sees open, in the same order), so that
    ``base`` is the clock's version when the run started.
    """

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self._versions: dict[Id, int] = {}

    def __contains__(self, batch_id: Id) -> bool:
        return batch_id in self._versions

    def version(self, batch_id: Id) -> int:
        """The learner version of ``batch_id`` (a new id gets the next one)."""
        return self._versions.setdefault(batch_id, self.base + len(self._versions))
