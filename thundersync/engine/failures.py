"""Failure reports between ranks, through the ``torch.distributed`` store (no torch import).

A rank about to stop writes why under ``thundersync/failed/{rank}``; a rank whose collective or
wait failed reads the reports of the others, so its error names the rank that failed and the
cause instead of only "timed out". A rank that hangs (alive, but never reaching the next
collective) reports nothing; :class:`Arrivals` finds it instead: each rank counts the collectives
of one sequence it has entered, under ``thundersync/at/{sequence}/{rank}``, and a rank whose count
is behind this rank's never reached the collective that timed out. :func:`introduce` records each
rank's host and process id (``thundersync/who/{rank}``), and its role in a rollout/learner split
when it has one (``thundersync/role/{rank}``), so that the error can name them. Ranks are always
the world's (global) ranks, also for a sequence of a smaller process group.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "TIMEOUT_HINT",
    "Arrivals",
    "describe_failures",
    "describe_rank",
    "introduce",
    "report_failure",
    "role_of",
    "settle",
    "timed_out",
    "whereabouts",
]

_FAILED = "thundersync/failed/"
_AT = "thundersync/at/"
_WHO = "thundersync/who/"
_ROLE = "thundersync/role/"

TIMEOUT_HINT = (
    "if the ranks are only slow, give them more time: THUNDERSYNC_DIST_TIMEOUT_S under `thundersync run` "
    "(seconds, default 600), timeout_s= in code"
)
"""What to do about a wait that timed out because a rank was slow rather than stuck."""


def report_failure(store: Any, rank: int, error: BaseException) -> None:
    """Record why ``rank`` stops (best effort: the store may already be gone)."""
    with contextlib.suppress(Exception):  # the store died with the run: the others time out instead
        store.set(f"{_FAILED}{rank}", f"{type(error).__name__}: {error}"[:2000])


def introduce(store: Any, rank: int, role: str = "") -> None:
    """Record this process's host and pid as ``rank``'s, and its ``role`` when given (best effort)."""
    with contextlib.suppress(Exception):
        store.set(f"{_WHO}{rank}", f"{socket.gethostname()} {os.getpid()}")
        if role:
            store.set(f"{_ROLE}{rank}", role)


def role_of(store: Any, rank: int) -> str:
    """The role :func:`introduce` recorded for ``rank`` (``"learner"``, ``"rollout"``), or ``""``."""
    key = f"{_ROLE}{rank}"
    try:  # check first: a store's get waits for a missing key
        return store.get(key).decode(errors="replace") if store.check([key]) else ""
    except Exception:
        return ""


def describe_rank(store: Any, rank: int) -> str:
    """``"rank 1 (learner, host h, pid 123, still running)"``: its role and :func:`whereabouts` in
    brackets, as far as they are known (``"rank 1"`` when nothing is)."""
    known = ", ".join(part for part in (role_of(store, rank), whereabouts(store, rank)) if part)
    return f"rank {rank} ({known})" if known else f"rank {rank}"


def whereabouts(store: Any, rank: int) -> str:
    """``"host h, pid 123, still running"``: what :func:`introduce` recorded for ``rank``, and
    whether that process still runs when it is on this host; ``""`` when nothing is known."""
    key = f"{_WHO}{rank}"
    try:  # check first: a store's get waits for a missing key
        host, pid = store.get(key).decode(errors="replace").rsplit(" ", 1) if store.check([key]) else ("", "")
    except Exception:
        return ""
    if not host:
        return ""
    state = ""
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
            state = ", no longer running" if _zombie(int(pid)) else ", still running"
        except ProcessLookupError:
            state = ", no longer running"
        except OSError:  # another user's process: it exists
            state = ", still running"
    return f"host {host}, pid {pid}{state}"


def settle(store: Any, ranks: Sequence[int], seconds: float = 2.0) -> None:
    """Wait up to ``seconds`` while any of ``ranks`` is a process on this host that still runs:
    after a broken connection its peer is often still exiting, and :func:`whereabouts` should
    then say how it ended, not catch it halfway."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(whereabouts(store, rank).endswith("still running") for rank in ranks):
        time.sleep(0.02)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has ended but its parent has not collected it yet (Linux: state Z; False
    where ``/proc`` cannot say)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def describe_failures(store: Any, world_size: int, *, me: int) -> str:
    """``"; rank 1: ValueError: ..."`` for every other rank that reported, or what is known."""
    reports = _reports(store, world_size, me=me)
    if reports is None:
        return "; the store is unreachable too: a rank (or the host serving the store) has died"
    if not reports:
        return "; no rank reported a cause (one died or hung)"
    return "; " + "; ".join(reports)


class Arrivals:
    """How far each rank got in one sequence of collectives that every rank enters in the same
    order (the gradient reductions of a run, the step records' gathers), through ``store``.

    Call :meth:`arrive` before each collective of the sequence; when one fails,
    :meth:`explain` says which ranks never entered it (they hang, are slower than the timeout,
    or died), or else why the ranks that reported a failure stopped. ``rank`` is this rank in the
    world of ``world_size`` ranks; ``ranks`` the world ranks that take part in the sequence
    (default: all of them).
    """

    def __init__(
        self, store: Any, sequence: str, *, rank: int, world_size: int, ranks: Sequence[int] | None = None
    ) -> None:
        self.store, self.sequence, self.rank, self.world_size = store, sequence, rank, world_size
        self.ranks = list(range(world_size)) if ranks is None else list(ranks)
        self.count = 0  # collectives of the sequence this rank has entered

    def arrive(self) -> None:
        """This rank enters the next collective of the sequence (best effort: the store may be gone)."""
        self.count += 1
        with contextlib.suppress(Exception):
            self.store.set(self._key(self.rank), str(self.count))

    def missing(self) -> list[int] | None:
        """The other ranks that have not entered this rank's latest collective (None: the store
        cannot be read)."""
        behind = []
        try:
            for rank in self.ranks:
                key = self._key(rank)
                count = int(self.store.get(key)) if self.store.check([key]) else 0
                if rank != self.rank and count < self.count:
                    behind.append(rank)
        except Exception:
            return None
        return behind

    def explain(self, what: str, timeout_s: float, error: BaseException) -> str:
        """One line: why ``what`` (this rank's latest collective) failed with ``error``."""
        reports = _reports(self.store, self.world_size, me=self.rank)
        if reports:
            return f"{what} failed: " + "; ".join(reports)
        missing = self.missing() or []
        if missing and timed_out(error):
            who = ", ".join(describe_rank(self.store, rank) for rank in missing)
            return (
                f"{who} did not reach {what} within {timeout_s:g} s and reported no failure: hung, or slower "
                f"than that; {TIMEOUT_HINT}"
            )
        cause = " ".join(f"{type(error).__name__}: {error}".split())[:500]
        behind = ""  # e.g. a broken connection: a rank that never entered it may be the one that died
        if missing:
            settle(self.store, missing)
            behind = "; " + ", ".join(describe_rank(self.store, rank) for rank in missing) + " had not reached it"
        return f"{what} failed ({cause}){describe_failures(self.store, self.world_size, me=self.rank)}{behind}"

    def _key(self, rank: int) -> str:
        return f"{_AT}{self.sequence}/{rank}"


def timed_out(error: BaseException) -> bool:
    """Whether a collective's ``error`` is a timeout (gloo: "Operation timed out!", "Timed out
    waiting ... for recv"; NCCL and the store: "timeout", "timed out")."""
    text = f"{type(error).__name__} {error}".lower()
    return "timed out" in text or "timeout" in text


def _reports(store: Any, world_size: int, *, me: int) -> list[str] | None:
    reports = []
    for rank in range(world_size):
        key = f"{_FAILED}{rank}"
        try:
            if rank != me and store.check([key]):
                reports.append(f"rank {rank}: {store.get(key).decode(errors='replace')}")
        except Exception:
            return None
    return reports
