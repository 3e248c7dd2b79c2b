"""`PolicyClock`: the published policy version, shared by step (publishes) and generate (waits).

A graph is acyclic, so the step -> generate feedback of ARCHITECTURE.md ("generate may start the
next batch only on the published policy") travels through this runtime object, not an edge::

    clock = PolicyClock()
    graph.add("generate", GenerateStage(cfg, generator=g, policy=clock), reads=["source"])
    graph.add("step", StepStage(policy=clock), reads=["close"])

The step stage calls :meth:`publish` after the optimizer step completed; the generate stage calls
:meth:`wait_for` before it starts batch ``n`` (it needs version ``n``: zero staleness).
"""

from __future__ import annotations

import anyio

from thundersync.errors import ConfigError

__all__ = ["PolicyClock"]


class PolicyClock:
    """A monotonically increasing policy version that tasks can wait on."""

    def __init__(self, version: int = 0) -> None:
        if version < 0:
            raise ConfigError(f"a policy version must be >= 0, got {version}")
        self.version = version
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

    def __repr__(self) -> str:
        return f"PolicyClock(version={self.version})"
