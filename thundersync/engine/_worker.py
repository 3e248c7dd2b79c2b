"""Off-thread execution of the engine's GPU work, in submission order, owned by the run.

Jobs run strictly first-in first-out, so their results do not depend on timing: the caller's
thread decides what each job does; the worker only decides when. The thread exists only while
jobs are queued: it starts on a submit and ends when the queue is empty, so an idle run holds
no thread. A job's exception stops the worker, drops the jobs queued behind it and is raised
(chained) to the caller at its next ``submit`` or ``join``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from thundersync.errors import StreamingError

__all__ = ["Worker"]


class Worker:
    """Runs ``submit``-ted jobs on one short-lived thread, or inline when ``background`` is off."""

    def __init__(self, *, background: bool, name: str = "thundersync-engine") -> None:
        self.background = background
        self._name = name
        self._jobs: collections.deque[tuple[str, Callable[[], None]]] = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: tuple[str, BaseException] | None = None
        self._running: str | None = None

    def submit(self, label: str, job: Callable[[], None]) -> None:
        """Queue ``job`` (described by ``label`` in errors); raises a failure of an earlier job."""
        self.raise_if_failed()
        if not self.background:
            self._run(label, job)
            self.raise_if_failed()
            return
        with self._lock:
            self._jobs.append((label, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def join(self) -> None:
        """Wait until every queued job has run; raises the first failure."""
        self._wait()
        self.raise_if_failed()

    def clear(self) -> None:
        """Wait for the thread to finish, then forget a failure (the caller abandons its batch)."""
        self._wait()
        self._error = None

    def _wait(self) -> None:
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            thread.join()

    def pending(self) -> list[str]:
        """Labels of the running and queued jobs."""
        with self._lock:
            running = [self._running] if self._running else []
            return running + [label for label, _ in self._jobs]

    def raise_if_failed(self) -> None:
        if self._error is not None:
            label, error = self._error
            raise StreamingError(
                f"engine work failed in {label}: {type(error).__name__}: {error}; the batch's gradients "
                "are incomplete: call discard() on the objective (or the run) and start the batch again"
            ) from error

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._jobs or self._error is not None:
                    self._jobs.clear()
                    self._thread = None
                    return
                label, job = self._jobs.popleft()
                self._running = label
            self._run(label, job)
            with self._lock:
                self._running = None

    def _run(self, label: str, job: Callable[[], None]) -> None:
        if self._error is not None:
            return
        try:
            job()
        except BaseException as error:
            self._error = (label, error)
