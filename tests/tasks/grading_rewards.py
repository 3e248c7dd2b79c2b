"""Reward functions over grading output for the grader tests (imported by ``module:function``)."""

from __future__ import annotations

from typing import Any


def printed_ok(output: str, exit_status: int | None, task: dict[str, Any]) -> float:
    """1 when the test printed ``ok`` and exited 0 for the task ``ops-1``."""
    return float("ok" in output and exit_status == 0 and task["id"] == "ops-1")


def broken(output: str, exit_status: int | None, task: dict[str, Any]) -> float:
    return 1 / 0
