"""The documented environment variables do what the README says."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from thundersync.sandboxes import docker, udocker


def test_udocker_is_run_with_an_allow_listed_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UDOCKER_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("API_TOKEN", "secret")
    env = udocker.udocker_env(tmp_path / "private")
    assert env["UDOCKER_DIR"] == str(tmp_path / "store") and env["UDOCKER_TARBALL"] == ""
    assert env["HOME"] == env["TMPDIR"] == str(tmp_path / "private") and "API_TOKEN" not in env


def test_a_udocker_command_sees_the_images_environment_then_roots(tmp_path: Path) -> None:
    config = tmp_path / "container.json"
    config.write_text(json.dumps({"config": {"Env": ["PATH=/opt/bin:/bin", "LANG=C.UTF-8", "=x", "no-equals", 3]}}))
    env = udocker.image_env(config)
    assert env == {"PATH": "/opt/bin:/bin", "LANG": "C.UTF-8", "HOME": "/root", "USER": "root", "LOGNAME": "root"}
    config.write_text("not json")
    assert udocker.image_env(config)["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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
