"""A test-only reward function for data-parallel runs: fails on one rank, on request.

``THUNDERSYNC_TEST_FAIL_RANK`` names the rank that fails and ``THUNDERSYNC_TEST_FAIL_HOW`` how:
``raise`` (a ValueError: the rank reports it and exits) or ``kill`` (SIGKILL: no word at all).
It fails on that rank's third call, so the run is under way (mid-batch) when it does.
"""

from __future__ import annotations

import os
import signal
from typing import Any

_calls = 0


def even_tokens(prompt: list[int], completion: list[int], task: dict[str, Any]) -> float:
    """The share of even token ids in the completion (``test-fake-scorer``'s reward), or a failure."""
    global _calls
    _calls += 1
    if os.environ.get("RANK") == os.environ.get("THUNDERSYNC_TEST_FAIL_RANK") and _calls == 3:
        if os.environ.get("THUNDERSYNC_TEST_FAIL_HOW") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"reward crashed on rank {os.environ['RANK']} (test)")
    return sum(1 for token in completion if token % 2 == 0) / max(len(completion), 1)
