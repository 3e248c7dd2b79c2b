"""Fixtures of the tool tests: a local-backend sandbox runner in a private scratch root."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from thundersync.sandboxes import Sandbox, SandboxLimits, make_sandbox
from thundersync.sandboxes._process import unshare_available
from thundersync.sandboxes.local import NotIsolatedWarning
from thundersync.tools import SandboxToolRunner

MakeRunner = Callable[..., SandboxToolRunner]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _local(limits: SandboxLimits) -> Sandbox:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotIsolatedWarning)
        return make_sandbox("local", limits=limits)


@pytest.fixture
def local_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MakeRunner:
    """``local_runner(limits, **kwargs)``: a SandboxToolRunner over local sandboxes (skips where they cannot run)."""
    problem = unshare_available()
    if problem is not None:
        pytest.skip(f"the local sandbox backend cannot run here: {problem}")
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(tmp_path / "scratch"))

    def make(limits: SandboxLimits | None = None, **kwargs: Any) -> SandboxToolRunner:
        limits = limits or SandboxLimits(timeout_s=kwargs.get("timeout_s", 10.0))
        return SandboxToolRunner(lambda: _local(limits), **kwargs)

    return make
