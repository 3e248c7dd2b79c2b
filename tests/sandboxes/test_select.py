"""Backend choice, messages that say what to do, pruning only our own containers, unsafe roots."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from thundersync.errors import MissingExtraError, SandboxUnavailable, UnsafePathError
from thundersync.sandboxes import LocalSandbox, NotIsolatedWarning, Sandbox, choose_backend, make_sandbox, open_sandbox
from thundersync.sandboxes import docker as docker_backend
from thundersync.sandboxes.base import LABEL, OWNER_LABEL

pytestmark = pytest.mark.anyio


async def test_an_unknown_backend_name_is_refused_with_the_choices() -> None:
    with pytest.raises(
        ValueError, match="unknown sandbox backend 'dokcer'; choose one of auto, docker, udocker, local"
    ):
        await choose_backend("dokcer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the docker backend needs an image"):
        make_sandbox("docker")


def test_the_local_backend_warns_that_it_is_not_an_isolation_boundary() -> None:
    with pytest.warns(NotIsolatedWarning, match="not an isolation boundary"):
        LocalSandbox()


async def test_auto_finds_nothing_and_says_what_it_tried(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no.sock")
    monkeypatch.setenv("THUNDERSYNC_UDOCKER_BIN", str(tmp_path / "no-udocker"))
    with pytest.raises(
        SandboxUnavailable,
        match="no sandbox backend can run here. docker: .*udocker: uDocker is "
        "not installed .*no-udocker.* not found\\): pip install 'thundersync\\[sandbox\\]'.*"
        "ask for it by name",
    ):
        await choose_backend("auto")


@pytest.mark.docker
async def test_auto_prefers_docker_when_its_daemon_answers(need: Callable[[str], None]) -> None:
    need("docker")
    assert await choose_backend("auto") == "docker"


@pytest.mark.docker
async def test_auto_falls_back_to_udocker_without_a_docker_daemon(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, scratch: Path, need: Callable[[str], None], image: str
) -> None:
    need("udocker")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no.sock")
    assert await choose_backend("auto") == "udocker"
    async with open_sandbox(image) as sandbox:
        assert (await sandbox.exec("cat README")).stdout == "hello from the seed\n"
        assert type(sandbox).__name__ == "UDockerSandbox"


def test_the_docker_backend_without_aiodocker_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aiodocker", None)
    with pytest.raises(
        MissingExtraError,
        match="the Docker sandbox backend needs the 'sandbox' extra .*pip install 'thundersync\\[sandbox\\]'",
    ):
        docker_backend.docker_client()


@pytest.mark.docker
async def test_a_missing_image_is_reported_with_how_to_fix(
    backend: str, scratch: Path, host_clean: Callable[[], Awaitable[None]]
) -> None:
    if backend == "local":
        pytest.skip("the local backend has no images")
    with pytest.raises(
        SandboxUnavailable, match="no-such/image:0.*(build or import it|import it with 'udocker import)"
    ):
        async with make_sandbox("docker" if backend == "podman" else backend, "no-such/image:0"):
            pass
    await host_clean()


async def test_a_scratch_root_owned_by_another_user_is_refused_before_anything_is_made(
    new_sandbox: Callable[..., Sandbox], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 1000, 1000)
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(theirs))
    with pytest.raises(
        UnsafePathError,
        match=f"scratch root {theirs} is owned by uid 1000, not you \\(uid 0\\): "
        "chown it or set THUNDERSYNC_SANDBOX_SCRATCH to a directory you own",
    ):
        async with new_sandbox():
            pass
    assert os.listdir(theirs) == []


@pytest.mark.docker
async def test_prune_removes_only_our_own_labelled_containers(need: Callable[[str], None], image: str) -> None:
    need("docker")
    cli = docker_backend.docker_cli()

    def create(owner: str) -> str:
        argv = [
            cli,
            "create",
            "--label",
            f"{LABEL}=1",
            "--label",
            f"{OWNER_LABEL}={owner}",
            "--network",
            "none",
            image,
            "true",
        ]
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()

    ours, theirs = create(docker_backend.default_owner()), create("uid4242@elsewhere")
    unlabelled = subprocess.run(
        [cli, "create", "--network", "none", image, "true"], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        assert await docker_backend.prune_containers() == 1
        left = subprocess.run(
            [cli, "ps", "-aq", "--no-trunc"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert ours not in left and theirs in left and unlabelled in left
    finally:
        subprocess.run([cli, "rm", "-f", ours, theirs, unlabelled], capture_output=True, check=False)
