"""The documented environment variables do what the README says."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from thundersync.sandboxes import docker, udocker


def test_a_users_proot_tmp_dir_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UDOCKER_USE_PROOT_EXECUTABLE", "/usr/bin/proot")
    monkeypatch.setenv("PROOT_TMP_DIR", str(tmp_path / "mine"))
    assert udocker.udocker_env(tmp_path / "private")["PROOT_TMP_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("PROOT_TMP_DIR")
    assert udocker.udocker_env(tmp_path / "private")["PROOT_TMP_DIR"] == str(tmp_path / "private")


def fake_cli(tmp_path: Path, answer: str) -> Path:
    cli = tmp_path / "fake-docker"
    cli.write_text(f'#!/bin/sh\n[ "$1" = context ] && echo "{answer}" && exit 0\nexit 1\n')
    cli.chmod(0o755)
    return cli


def test_thundersync_docker_bin_chooses_the_engine_when_docker_host_is_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("aiodocker")
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setenv("THUNDERSYNC_DOCKER_BIN", str(fake_cli(tmp_path, "unix:///run/elsewhere.sock")))

    async def engine() -> str:
        client = docker.docker_client()
        try:
            return str(client.connector.path)
        finally:
            await client.close()

    assert anyio.run(engine) == "/run/elsewhere.sock"
    monkeypatch.setenv("THUNDERSYNC_DOCKER_BIN", str(fake_cli(tmp_path, "")))
    with pytest.raises(docker.SandboxUnavailable, match="names no engine socket"):
        docker._cli_socket()
