"""Pools of sandboxes, keyed by image, reused after a reset that is verified from the host.

    >>> pools = SandboxPools(lambda image: make_sandbox("docker", image), max_size=8, warm={"busybox:1": 2})  # doctest: +SKIP
    >>> async with pools:                                      # starts the two warm sandboxes # doctest: +SKIP
    ...     sandbox = await pools.take("busybox:1")            # an idle one, or a new one
    ...     result = await sandbox.exec("pytest -q")
    ...     await pools.put_back("busybox:1", sandbox)         # reset, verified, idle again

At most ``max_size`` sandboxes are in use at once, over every key; ``take`` waits for one to be
put back. On ``put_back`` the sandbox is reset (its processes killed, its tree restored); if the
reset proves it clean it joins its key's idle list, otherwise (or if the reset raised) it is closed
and, while its key holds fewer than its ``warm`` count, a fresh one replaces it. At most
``max_idle`` sandboxes wait idle (over every key); past it the one idle longest is closed.
:class:`SandboxPool` is the same for one image (``acquire()`` takes and puts back around a block).
Leaving the pool closes every idle member and every member put back afterwards.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable, Mapping
from contextlib import asynccontextmanager

import anyio
import msgspec

from thundersync._logging import get_logger
from thundersync.errors import ConfigError, SandboxError
from thundersync.sandboxes.base import Sandbox

__all__ = ["PoolStats", "SandboxPool", "SandboxPools"]

log = get_logger("thundersync.sandboxes")


class PoolStats(msgspec.Struct):
    """Counters of a pool (a snapshot; ``in_use`` and ``idle`` are current). ``take_s`` and
    ``reset_s`` are the seconds spent in ``take`` (waiting, creating) and in resets, in all."""

    created: int = 0
    reused: int = 0
    reset_ok: int = 0
    discarded: int = 0
    in_use: int = 0
    idle: int = 0
    takes: int = 0
    take_s: float = 0.0
    resets: int = 0
    reset_s: float = 0.0


class SandboxPools:
    """Sandboxes made by ``factory(key)`` (the key is usually the image), at most ``max_size`` in
    use over every key, reused after a verified reset; see the module docstring."""

    def __init__(
        self,
        factory: Callable[[Hashable], Sandbox],
        *,
        max_size: int,
        max_idle: int | None = None,
        warm: Mapping[Hashable, int] | None = None,
    ) -> None:
        warm = dict(warm or {})
        if max_size < 1 or (max_idle is not None and max_idle < 0) or any(n < 0 for n in warm.values()):
            raise ConfigError(
                f"SandboxPools needs max_size >= 1, max_idle >= 0 and warm counts >= 0; got max_size={max_size}, "
                f"max_idle={max_idle}, warm={warm}"
            )
        if sum(warm.values()) > min(max_size, max_idle if max_idle is not None else max_size):
            raise ConfigError(f"the warm sandboxes ({sum(warm.values())}) must fit max_size and max_idle")
        self._factory = factory
        self._slots = anyio.Semaphore(max_size)
        self._max_idle = max_size if max_idle is None else max_idle
        self._warm = warm
        self._idle: OrderedDict[int, tuple[Hashable, Sandbox]] = OrderedDict()  # oldest first
        self._live: dict[Hashable, int] = {}  # in use or idle, per key
        self._stats = PoolStats()
        self._closed = False

    @property
    def stats(self) -> PoolStats:
        return msgspec.structs.replace(self._stats, idle=len(self._idle))

    async def __aenter__(self) -> SandboxPools:
        """Start the warm sandboxes (concurrently) before anything is taken."""
        async with anyio.create_task_group() as group:
            for key, count in self._warm.items():
                for _ in range(count - self._live.get(key, 0)):
                    group.start_soon(self._add_idle, key)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle member; members in use are closed when they are put back."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            while self._idle:
                _, (key, sandbox) = self._idle.popitem(last=False)
                await self._close(key, sandbox)

    async def take(self, key: Hashable) -> Sandbox:
        """A started sandbox of ``key`` for one user (an idle one, already reset, or a new one);
        give it back with :meth:`put_back`."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed: take sandboxes before leaving 'async with pool'")
        started = time.perf_counter()
        await self._slots.acquire()
        try:
            sandbox = self._idle_of(key)
            if sandbox is None:
                sandbox = await self._create(key)
            else:
                self._stats.reused += 1
        except BaseException:
            self._slots.release()
            raise
        self._stats.in_use += 1
        self._stats.takes += 1
        self._stats.take_s += time.perf_counter() - started
        return sandbox

    async def put_back(self, key: Hashable, sandbox: Sandbox) -> None:
        """Reset ``sandbox`` and keep it idle if the reset proves it clean, else close it."""
        try:
            with anyio.CancelScope(shield=True):
                await self._give_back(key, sandbox)
        finally:
            self._stats.in_use -= 1
            self._slots.release()

    # -- internals ---------------------------------------------------------------------------

    def _idle_of(self, key: Hashable) -> Sandbox | None:
        for index, (idle_key, sandbox) in self._idle.items():
            if idle_key == key:
                del self._idle[index]
                return sandbox
        return None

    async def _create(self, key: Hashable) -> Sandbox:
        sandbox = self._factory(key)
        await sandbox.__aenter__()
        self._live[key] = self._live.get(key, 0) + 1
        self._stats.created += 1
        return sandbox

    async def _add_idle(self, key: Hashable) -> None:
        await self._keep_idle(key, await self._create(key))

    async def _keep_idle(self, key: Hashable, sandbox: Sandbox) -> None:
        while len(self._idle) >= self._max_idle and self._idle:
            _, (old_key, old) = self._idle.popitem(last=False)
            await self._close(old_key, old)
        if self._max_idle == 0:
            await self._close(key, sandbox)
            return
        self._idle[id(sandbox)] = (key, sandbox)

    async def _close(self, key: Hashable, sandbox: Sandbox) -> None:
        self._live[key] -= 1
        await sandbox.close()

    async def _give_back(self, key: Hashable, sandbox: Sandbox) -> None:
        if self._closed:
            await self._close(key, sandbox)
            return
        started = time.perf_counter()
        try:
            clean = await sandbox.reset()
        except Exception as error:
            log.warning("sandbox reset failed; discarding it", name=sandbox.name, error=repr(error))
            clean = False
        self._stats.resets += 1
        self._stats.reset_s += time.perf_counter() - started
        if clean:
            self._stats.reset_ok += 1
            await self._keep_idle(key, sandbox)
            return
        self._stats.discarded += 1
        await self._close(key, sandbox)
        if self._live.get(key, 0) < self._warm.get(key, 0):
            try:
                await self._add_idle(key)  # keep the key warm
            except Exception as error:
                log.warning("could not replace a discarded warm sandbox", key=repr(key), error=repr(error))


class SandboxPool:
    """At most ``max_size`` sandboxes made by ``factory``, reused after a verified reset; ``warm``
    of them are started on entry (a :class:`SandboxPools` of one key)."""

    def __init__(self, factory: Callable[[], Sandbox], *, max_size: int, warm: int = 0) -> None:
        if max_size < 1:
            raise ConfigError(f"SandboxPool max_size must be >= 1, got {max_size}")
        self._pools = SandboxPools(lambda _key: factory(), max_size=max_size, warm={"": warm} if warm else None)

    @property
    def stats(self) -> PoolStats:
        return self._pools.stats

    async def __aenter__(self) -> SandboxPool:
        await self._pools.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle member; members in use are closed when they are released."""
        await self._pools.aclose()

    async def take(self) -> Sandbox:
        """A sandbox for one user; give it back with :meth:`put_back`."""
        return await self._pools.take("")

    async def put_back(self, sandbox: Sandbox) -> None:
        """Reset and keep (if proven clean) or close ``sandbox``."""
        await self._pools.put_back("", sandbox)

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[Sandbox]:
        """A sandbox for one block: an idle one (already reset) or a new one, put back after."""
        sandbox = await self.take()
        try:
            yield sandbox
        finally:
            await self.put_back(sandbox)
