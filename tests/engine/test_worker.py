"""The worker runs jobs in order, holds no idle thread, and hands failures to the caller."""

from __future__ import annotations

import threading

import pytest

from thundersync.engine._worker import Worker
from thundersync.errors import StreamingError


@pytest.mark.parametrize("background", [False, True])
def test_jobs_run_in_submission_order_and_failures_surface_on_the_next_call(background: bool) -> None:
    worker = Worker(background=background)
    seen: list[int] = []
    for i in range(50):
        worker.submit(f"job {i}", lambda i=i: seen.append(i))
    worker.join()
    assert seen == list(range(50))

    def boom() -> None:
        raise RuntimeError("kaput")

    try:
        worker.submit("the boom job", boom)
    except StreamingError:
        assert not background  # inline: raised at once
    with pytest.raises(StreamingError, match="failed in the boom job: RuntimeError: kaput"):
        worker.join()
    with pytest.raises(StreamingError, match="the boom job"):
        worker.submit("after", lambda: seen.append(-1))
    assert -1 not in seen


def test_an_idle_worker_holds_no_thread() -> None:
    worker = Worker(background=True)
    release = threading.Event()
    worker.submit("wait", release.wait)
    assert any(t.name == "thundersync-engine" for t in threading.enumerate())
    release.set()
    worker.join()
    assert worker.pending() == []
    assert not any(t.name == "thundersync-engine" for t in threading.enumerate())
