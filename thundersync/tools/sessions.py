"""`TrajectorySandboxes`: one sandbox per trajectory, from its first tool call to its release.

    sessions = TrajectorySandboxes(pools, workspaces, default_image="busybox:1")
    session = await sessions.get(("g", 0), env, task="'astropy-12907'")   # first call: acquire, place, set up
    ...                                                                    # every later turn: the same one
    await sessions.release(("g", 0))                                       # reset, verified, back to its pool

A trajectory's sandbox is taken from the pool of its image (the task's, else ``default_image``)
when something first needs it, its task's content is placed and its setup run; it stays the
trajectory's, with its files (and, on Docker, its background processes), until
:meth:`TrajectorySandboxes.release`, which resets it and gives it back (the pool closes a
sandbox whose reset cannot prove it clean). With ``slots`` (an admission's sandbox slots), a
trajectory holds one slot from the moment it takes a sandbox until its release, so trajectories
holding sandboxes are bounded however long their episodes. A sandbox that cannot be taken, placed
or set up raises :class:`~thundersync.errors.EpisodeError` naming the task and the cause.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import anyio

from thundersync.errors import ConfigError, EpisodeError, SandboxError
from thundersync.sandboxes import Sandbox, SandboxPools
from thundersync.tools.workspace import TaskEnvironment, Workspaces

__all__ = ["SandboxSlots", "Session", "TrajectorySandboxes"]

Key = tuple[Hashable, Hashable]  # (group id, trajectory id)


@runtime_checkable
class SandboxSlots(Protocol):
    """Bounds the trajectories that hold a sandbox (:class:`~thundersync.scheduling.Admission` is one)."""

    async def hold_sandbox_slot(self, holder: Hashable) -> None:
        """Wait for a free slot and hold it for ``holder``."""
        ...

    def release_sandbox_slot(self, holder: Hashable) -> None:
        """Give back ``holder``'s slot (nothing if it holds none)."""
        ...


@dataclass(eq=False)
class Session:
    """A trajectory's sandbox: which pool it came from and the task environment placed in it."""

    key: Key
    image: str
    sandbox: Sandbox
    env: TaskEnvironment | None


class TrajectorySandboxes:
    """The sandboxes held by open trajectories; see the module docstring."""

    def __init__(
        self,
        pools: SandboxPools,
        workspaces: Workspaces,
        *,
        default_image: str = "",
        images: bool = True,
        grading: SandboxPools | None = None,
    ) -> None:
        self.pools, self.workspaces = pools, workspaces
        self.grading = grading if grading is not None else pools
        self.default_image = default_image
        self.images = images  # whether a task may name its own image
        self.slots: SandboxSlots | None = None
        self._sessions: dict[Key, Session] = {}
        self._locks: dict[Key, anyio.Lock] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def peek(self, key: Key) -> Session | None:
        """The trajectory's session, if it holds one."""
        return self._sessions.get(key)

    def image_of(self, env: TaskEnvironment | None) -> str:
        """The image a trajectory of ``env`` runs in."""
        if env is None or env.image is None or env.image == self.default_image:
            return self.default_image
        if not self.images:
            raise ConfigError(
                f"the task asks for image {env.image!r}, but this runner's sandboxes are of one image "
                f"({self.default_image or 'the local backend'}); give the runner a backend with images"
            )
        return env.image

    async def get(self, key: Key, env: TaskEnvironment | None, *, task: str) -> Session:
        """The trajectory's session, acquired (slot, sandbox, content, setup) on its first use."""
        lock = self._locks.setdefault(key, anyio.Lock())
        async with lock:
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = await self._open(key, env, task)
            return session

    async def fresh(self, env: TaskEnvironment | None, *, task: str, trajectory: str) -> tuple[str, Sandbox]:
        """A sandbox of ``env``'s image from the ``grading`` pools, its content placed and set up,
        held by no trajectory: give it back with ``grading.put_back(image, sandbox)``. Graders take
        these, never the trajectories' own pools: a trajectory holding a sandbox waits for its
        reward, so a grader that waited for one of those would wait for itself."""
        image = self._image(env, task, trajectory)
        sandbox = await self._take(image, task, trajectory, self.grading)
        try:
            await self._prepare(sandbox, env, task, trajectory)
        except BaseException:
            await self.grading.put_back(image, sandbox)
            raise
        return image, sandbox

    async def release(self, key: Key) -> None:
        """Reset the trajectory's sandbox and give it back (nothing if it holds none)."""
        session = self._sessions.pop(key, None)
        self._locks.pop(key, None)
        try:
            if session is not None:
                await self.pools.put_back(session.image, session.sandbox)
        finally:
            if session is not None and self.slots is not None:
                self.slots.release_sandbox_slot(key)

    async def aclose(self) -> None:
        """Give back every sandbox still held (the run ended or failed)."""
        with anyio.CancelScope(shield=True):
            for key in list(self._sessions):
                await self.release(key)

    # -- internals ---------------------------------------------------------------------------

    def _image(self, env: TaskEnvironment | None, task: str, trajectory: str) -> str:
        try:
            return self.image_of(env)
        except ConfigError as error:
            raise EpisodeError(task=task, trajectory=trajectory, tool="sandbox", cause=str(error)) from None

    async def _open(self, key: Key, env: TaskEnvironment | None, task: str) -> Session:
        trajectory = f"trajectory {key[1]!r} of group {key[0]!r}"
        image = self._image(env, task, trajectory)
        if self.slots is not None:
            await self.slots.hold_sandbox_slot(key)
        try:
            sandbox = await self._take(image, task, trajectory)
            session = Session(key, image, sandbox, env)
            try:
                await self._prepare(sandbox, env, task, trajectory)
            except BaseException:
                await self.pools.put_back(image, sandbox)
                raise
        except BaseException:
            if self.slots is not None:
                self.slots.release_sandbox_slot(key)
            raise
        return session

    async def _take(self, image: str, task: str, trajectory: str, pools: SandboxPools | None = None) -> Sandbox:
        try:
            return await (pools or self.pools).take(image)
        except SandboxError as error:
            raise EpisodeError(task=task, trajectory=trajectory, tool="sandbox", cause=str(error)) from error

    async def _prepare(self, sandbox: Sandbox, env: TaskEnvironment | None, task: str, trajectory: str) -> None:
        """Place the task's content and run its setup commands."""
        if env is None:
            return
        try:
            await self.workspaces.place(sandbox, env)
        except (ConfigError, SandboxError, OSError) as error:
            cause = f"placing its content failed: {error}"
            raise EpisodeError(task=task, trajectory=trajectory, tool="setup", cause=cause) from error
        for command in env.setup:
            try:
                result = await sandbox.exec(command, timeout=env.setup_timeout_s)
            except (ConfigError, SandboxError) as error:
                raise EpisodeError(task=task, trajectory=trajectory, tool="setup", cause=str(error)) from error
            if not result.ok:
                status = "timed out" if result.timed_out else f"exited with {result.exit_code}"
                tail = (result.stdout + result.stderr)[-400:]
                cause = f"setup command {str(command)[:200]!r} {status}: {tail}"
                raise EpisodeError(task=task, trajectory=trajectory, tool="setup", cause=cause)
