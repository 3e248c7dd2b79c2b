"""The failure watch of a data-parallel launch, over an in-process store (no other process)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

from thundersync.app.cli._failure_watch import FAILURES, FailureWatch, mark_failed
from thundersync.engine.failures import report_failure


def _store() -> Any:
    return dist.HashStore()  # type: ignore[attr-defined]


def _watch(store: Any, ended: list[int]) -> FailureWatch:
    return FailureWatch(store, rank=0, world_size=3, grace_s=0.3, poll_s=0.02, end=ended.append)


def test_without_a_failure_the_watch_never_ends_the_rank() -> None:
    ended: list[int] = []
    with _watch(_store(), ended):
        time.sleep(0.5)
    assert ended == []


def test_a_rank_still_running_the_grace_after_another_failed_is_ended_with_a_line_naming_the_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    store, ended = _store(), list[int]()
    with _watch(store, ended):
        report_failure(store, 2, ValueError("reward crashed"))
        mark_failed(store)
        failed = time.monotonic()
        while not ended and time.monotonic() - failed < 5:
            time.sleep(0.01)
        after = time.monotonic() - failed
    assert ended == [1]
    assert 0.3 <= after < 0.3 + 1.0
    assert capsys.readouterr().err == (
        "thundersync: rank 0 of 3: stopping this rank, which has not ended 0.3 s after another rank failed (it "
        "hangs, or waits for a rank that is gone): rank 2: ValueError: reward crashed\n"
    )
    assert int(store.add(FAILURES, 0)) == 1


def test_a_rank_that_ends_within_the_grace_is_left_alone() -> None:
    store, ended = _store(), list[int]()
    with _watch(store, ended):
        mark_failed(store)
        time.sleep(0.1)
    time.sleep(0.4)
    assert ended == []
