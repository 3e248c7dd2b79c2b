"""Failure reports between ranks, through the ``torch.distributed`` store (no torch import).

A rank about to stop writes why under ``thundersync/failed/{rank}``; a rank whose collective or
wait failed reads the reports of the others, so its error names the rank that failed and the
cause instead of only "timed out".
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["describe_failures", "report_failure"]

_FAILED = "thundersync/failed/"


def report_failure(store: Any, rank: int, error: BaseException) -> None:
    """Record why ``rank`` stops (best effort: the store may already be gone)."""
    with contextlib.suppress(Exception):  # the store died with the run: the others time out instead
        store.set(f"{_FAILED}{rank}", f"{type(error).__name__}: {error}"[:2000])


def describe_failures(store: Any, world_size: int, *, me: int) -> str:
    """``"; rank 1: ValueError: ..."`` for every other rank that reported, or what is known."""
    reports = []
    for rank in range(world_size):
        key = f"{_FAILED}{rank}"
        try:
            if rank != me and store.check([key]):
                reports.append(f"rank {rank}: {store.get(key).decode(errors='replace')}")
        except Exception:
            return "; the store is unreachable too: a rank (or the host serving the store) has died"
    if not reports:
        return "; no rank reported a cause (one died or hung)"
    return "; " + "; ".join(reports)
