"""A failed data-parallel run ends on every rank, also on a rank that hangs on another node.

One ``torchrun`` agent runs per node and stops only its own node's workers when one of them
fails. The other nodes' ranks end by themselves at their next collective or wait (a broken
connection, or its timeout), but a rank that hangs never gets there; if its agent serves the
rendezvous store, nothing else ends it either. So every rank that fails counts itself in the store
(:func:`mark_failed`, under :data:`FAILURES`), and each rank's :class:`FailureWatch` (a daemon
thread that :func:`~thundersync.app.cli.distributed.launch` starts and stops) polls that count:
once a rank has failed and this process has not ended within ``grace_s`` (the collectives'
timeout, so a rank that only waits for the failed one ends first, with its own message), it writes
one line naming the failed ranks and their causes and exits with status 1, which its agent sees.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["FAILURES", "FailureWatch", "mark_failed"]

FAILURES = "thundersync/failures"
"""The store key counting the ranks of the run that have failed."""


def mark_failed(store: Any) -> None:
    """Count this rank among the failed ones (best effort: the store may already be gone)."""
    with contextlib.suppress(Exception):
        store.add(FAILURES, 1)


class FailureWatch:
    """Ends this process ``grace_s`` seconds after another rank's failure was counted, if it is
    still running then. Use it as a context manager around the rank's run.

    ``store`` is cloned (its own connection) when it can be, so that the watch's polls do not
    queue behind a wait of the rank's own threads.
    """

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        world_size: int,
        grace_s: float,
        poll_s: float | None = None,
        end: Callable[[int], object] = os._exit,
    ) -> None:
        self.store, self.rank, self.world_size, self.grace_s = _own_connection(store), rank, world_size, grace_s
        self.poll_s = poll_s if poll_s is not None else min(5.0, grace_s / 4)
        self._end = end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="thundersync-failure-watch", daemon=True)

    def __enter__(self) -> FailureWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.poll_s + 5)

    def _watch(self) -> None:
        seen = None  # when a failure was first counted
        while not self._stop.wait(self.poll_s):
            if seen is None:
                seen = time.monotonic() if self._failures() else None
            elif time.monotonic() - seen >= self.grace_s:
                self._stop_this_rank()
                return

    def _failures(self) -> int:
        try:
            return int(self.store.add(FAILURES, 0))
        except Exception:  # the store is gone: the launcher ends this node's workers
            return 0

    def _stop_this_rank(self) -> None:
        from thundersync.engine.failures import describe_failures

        causes = describe_failures(self.store, self.world_size, me=self.rank).removeprefix("; ")
        with contextlib.suppress(Exception):
            sys.stderr.write(
                f"thundersync: rank {self.rank} of {self.world_size}: stopping this rank, which has not ended "
                f"{self.grace_s:g} s after another rank failed (it hangs, or waits for a rank that is gone): {causes}\n"
            )
            sys.stderr.flush()
        self._end(1)


def _own_connection(store: Any) -> Any:
    try:
        return store.clone()
    except Exception:  # a store without clone(): share it
        return store
