"""Test-only reward functions for data-parallel runs: one fails on one rank, on request; one is slow.

``THUNDERSYNC_TEST_FAIL_RANK`` names the rank that fails (``any``: whichever rank reads it, for
a launcher that decides the ranks, such as one torchrun agent of several) and
``THUNDERSYNC_TEST_FAIL_HOW`` how: ``raise`` (a ValueError: the rank reports it and exits),
``kill`` (SIGKILL: no word at all) or ``hang`` (the rank's next optimizer step sleeps, alive, for
an hour: after the gradient reduction, so the other ranks next wait for it in the step records'
gather). It fails on that rank's third call, so the run is under way (mid-batch) when it does,
and first writes ``time.monotonic()`` into the file ``THUNDERSYNC_TEST_FAIL_MARK`` names, if any
(so that a test bounds the time from the failure, not from a start-up that load may slow down).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
from torch.optim.optimizer import register_optimizer_step_pre_hook

_calls = 0


def even_tokens(prompt: list[int], completion: list[int], task: dict[str, Any]) -> float:
    """The share of even token ids in the completion (``test-fake-scorer``'s reward), or a failure."""
    global _calls
    _calls += 1
    if os.environ.get("THUNDERSYNC_TEST_FAIL_RANK") in ("any", os.environ.get("RANK")) and _calls == 3:
        if mark := os.environ.get("THUNDERSYNC_TEST_FAIL_MARK"):
            Path(mark).write_text(repr(time.monotonic()))
        if os.environ.get("THUNDERSYNC_TEST_FAIL_HOW") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("THUNDERSYNC_TEST_FAIL_HOW") == "hang":
            register_optimizer_step_pre_hook(lambda *_: time.sleep(3600))
            return 0.0
        raise ValueError(f"reward crashed on rank {os.environ['RANK']} (test)")
    return sum(1 for token in completion if token % 2 == 0) / max(len(completion), 1)


async def slow_even_tokens(prompt: list[int], completion: list[int], task: dict[str, Any]) -> float:
    """``even_tokens``'s reward after a pause of ``THUNDERSYNC_TEST_REWARD_S`` seconds (default 0.3),
    so that a group stays in flight about as long as it takes the other rank to claim its share."""
    await anyio.sleep(float(os.environ.get("THUNDERSYNC_TEST_REWARD_S", "0.3")))
    return sum(1 for token in completion if token % 2 == 0) / max(len(completion), 1)
