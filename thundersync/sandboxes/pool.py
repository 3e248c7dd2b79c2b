"""A pool of sandboxes reused across tasks after a reset that is verified from the host.

    >>> pool = SandboxPool(lambda: make_sandbox("docker", "busybox:1"), max_size=8)  # doctest: +SKIP
    >>> async with pool:                                                             # doctest: +SKIP
    ...     async with pool.acquire() as sandbox:
    ...         result = await sandbox.exec("pytest -q")

``acquire`` waits while ``max_size`` sandboxes are in use. On release the sandbox is reset (its
processes killed, its tree restored); if the tree then equals its seed it goes back to the idle
list, otherwise (or if the reset raised) it is closed and a later ``acquire`` creates a new one.
Leaving the pool closes every idle member and every member released afterwards.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import msgspec

from thundersync._logging import get_logger
from thundersync.errors import ConfigError, SandboxError
from thundersync.sandboxes.base import Sandbox

__all__ = ["PoolStats", "SandboxPool"]

log = get_logger("thundersync.sandboxes")


class PoolStats(msgspec.Struct):
    """Counters of a :class:`SandboxPool` (a snapshot; ``in_use`` and ``idle`` are current)."""

    created: int = 0
    reused: int = 0
    reset_ok: int = 0
    discarded: int = 0
    in_use: int = 0
    idle: int = 0


class SandboxPool:
    """At most ``max_size`` sandboxes made by ``factory``, reused after a verified reset."""

    def __init__(self, factory: Callable[[], Sandbox], *, max_size: int) -> None:
        if max_size < 1:
            raise ConfigError(f"SandboxPool max_size must be >= 1, got {max_size}")
        self._factory = factory
        self._slots = anyio.Semaphore(max_size)
        self._idle: list[Sandbox] = []
        self._stats = PoolStats()
        self._closed = False

    @property
    def stats(self) -> PoolStats:
        return msgspec.structs.replace(self._stats, idle=len(self._idle))

    async def __aenter__(self) -> SandboxPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle member; members in use are closed when they are released."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            while self._idle:
                await self._idle.pop().close()

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[Sandbox]:
        """A sandbox for one task: an idle one (already reset) or a new one."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed: acquire before leaving 'async with pool'")
        async with self._slots:
            sandbox = await self._take()
            self._stats.in_use += 1
            try:
                yield sandbox
            finally:
                self._stats.in_use -= 1
                with anyio.CancelScope(shield=True):
                    await self._give_back(sandbox)

    async def _take(self) -> Sandbox:
        if self._idle:
            self._stats.reused += 1
            return self._idle.pop()
        sandbox = self._factory()
        await sandbox.__aenter__()
        self._stats.created += 1
        return sandbox

    async def _give_back(self, sandbox: Sandbox) -> None:
        if self._closed:
            await sandbox.close()
            return
        try:
            clean = await sandbox.reset()
        except Exception as error:
            log.warning("sandbox reset failed; discarding it", name=sandbox.name, error=repr(error))
            clean = False
        if clean:
            self._stats.reset_ok += 1
            self._idle.append(sandbox)
            return
        self._stats.discarded += 1
        await sandbox.close()
