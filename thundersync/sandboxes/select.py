"""Choosing a backend and opening sandboxes by name.

``auto`` takes Docker when its daemon answers, else uDocker when it can run here; the ``local``
backend (not an isolation boundary) is used only when asked for by name, and warns.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

import anyio

from thundersync.errors import ConfigError, SandboxUnavailable
from thundersync.sandboxes.base import Sandbox, SandboxLimits

__all__ = [
    "BackendName",
    "choose_backend",
    "docker_problem",
    "image_problem",
    "make_sandbox",
    "open_sandbox",
    "udocker_problem",
]

BackendName = Literal["auto", "docker", "udocker", "local"]
_BACKENDS = ("auto", "docker", "udocker", "local")


async def docker_problem() -> str | None:
    """None if a Docker (or Podman) daemon answers on ``DOCKER_HOST``/the default socket, else why not."""
    from thundersync.sandboxes.docker import docker_client

    try:
        client = docker_client()
    except Exception as error:
        return str(error)
    try:
        with anyio.fail_after(10):  # Podman's first answer can take seconds on a busy machine
            await client.version()
        return None
    except Exception as error:
        return f"the Docker daemon does not answer: {type(error).__name__}: {error}"
    finally:
        await client.close()


async def image_problem(backend: str, image: str) -> str | None:
    """None if ``backend`` (``docker`` or ``udocker``) has ``image`` here, else why not and what to do
    (no registry is pulled from). For Docker, the daemon must answer (:func:`docker_problem`)."""
    if backend == "udocker":
        from thundersync.sandboxes.udocker import udocker_image

        try:
            udocker_image(image)
        except SandboxUnavailable as error:
            return str(error)
        return None
    from thundersync.sandboxes.docker import docker_client

    client = docker_client()
    try:
        with anyio.fail_after(10):
            await client.images.inspect(image)
        return None
    except Exception as error:
        cause = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        return f"Docker has no image {image!r} ({cause}): build or import it first (no registry is pulled from)"
    finally:
        await client.close()


def udocker_problem() -> str | None:
    """None if uDocker can run sandboxes here (udocker, namespaces), else why not."""
    from thundersync.sandboxes import _process
    from thundersync.sandboxes.udocker import udocker_bin

    try:
        udocker_bin()
    except SandboxUnavailable as error:
        return str(error)
    return _process.unshare_available()


async def choose_backend(backend: BackendName = "auto") -> str:
    """The backend to use for ``backend``; raises :class:`SandboxUnavailable` saying what was tried."""
    if backend not in _BACKENDS:
        raise ConfigError(f"unknown sandbox backend {backend!r}; choose one of {', '.join(_BACKENDS)}")
    if backend != "auto":
        return backend
    docker_why = await docker_problem()
    if docker_why is None:
        return "docker"
    udocker_why = udocker_problem()
    if udocker_why is None:
        return "udocker"
    raise SandboxUnavailable(
        f"no sandbox backend can run here. docker: {docker_why}. udocker: {udocker_why}. "
        f"(The 'local' backend is not an isolation boundary; ask for it by name if you accept that.)"
    )


def make_sandbox(
    backend: str,
    image: str | None = None,
    *,
    limits: SandboxLimits | None = None,
    workdir: str | None = None,
    template: Path | None = None,
    name: str | None = None,
) -> Sandbox:
    """A not-yet-started sandbox of a concrete backend (enter it with ``async with``)."""
    if backend in ("docker", "udocker") and not image:
        raise ConfigError(f"the {backend} backend needs an image, e.g. image='busybox:latest'")
    if backend == "docker":
        from thundersync.sandboxes.docker import DockerSandbox

        return DockerSandbox(image or "", name=name, limits=limits, workdir=workdir)
    if backend == "udocker":
        from thundersync.sandboxes.udocker import UDockerSandbox

        return UDockerSandbox(image or "", name=name, limits=limits, workdir=workdir or "/work")
    if backend == "local":
        from thundersync.sandboxes.local import LocalSandbox

        return LocalSandbox(template, name=name, limits=limits)
    raise ConfigError(f"unknown sandbox backend {backend!r}; choose one of docker, udocker, local")


@asynccontextmanager
async def open_sandbox(
    image: str | None = None,
    *,
    backend: BackendName = "auto",
    limits: SandboxLimits | None = None,
    workdir: str | None = None,
    template: Path | None = None,
) -> AsyncIterator[Sandbox]:
    """``async with open_sandbox("img:tag") as sandbox:`` on the chosen backend; removed on exit."""
    chosen = await choose_backend(backend)
    async with make_sandbox(chosen, image, limits=limits, workdir=workdir, template=template) as sandbox:
        yield sandbox
