"""Fixtures of the pipeline tests: anyio's pytest plugin runs `@pytest.mark.anyio` tests on asyncio."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
