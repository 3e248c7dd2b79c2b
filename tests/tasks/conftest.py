"""Fixtures of the task tests: the asyncio backend and the stage tests' ``run_stage``."""

from __future__ import annotations

import pytest

from tests.stages.conftest import RunStage, _run_stage
from tests.tools.conftest import local_runner

__all__ = ["local_runner"]  # the tool tests' fixture: a runner over local sandboxes


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def run_stage() -> RunStage:
    """``await run_stage(stage, events)``: the events the stage sent, once its inbox ended."""
    return _run_stage
