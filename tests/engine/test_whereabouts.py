"""``whereabouts``: what a failure message says about a rank's process on this host."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from thundersync.engine.failures import introduce, whereabouts


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_that_ended_but_was_not_collected_yet_is_no_longer_running() -> None:
    store = dist.HashStore()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    store.set("thundersync/who/1", f"{socket.gethostname()} {child.pid}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # ended, not waited for: a zombie, which os.kill still finds
        with open(f"/proc/{child.pid}/stat", "rb") as stat:
            if stat.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        time.sleep(0.01)
    try:
        assert whereabouts(store, 1) == f"host {socket.gethostname()}, pid {child.pid}, no longer running"
    finally:
        child.wait()
    introduce(store, 0)
    assert whereabouts(store, 0) == f"host {socket.gethostname()}, pid {os.getpid()}, still running"


def test_a_sequence_of_a_smaller_group_names_its_world_ranks_with_their_roles() -> None:
    """Arrivals of a group of world ranks 1 and 3: only rank 3 can lag, and a broken connection
    (no timeout) names it, with the role it was introduced with, as never having reached it."""
    from thundersync.engine.failures import Arrivals, describe_rank

    store = dist.HashStore()
    introduce(store, 3, "learner")
    assert describe_rank(store, 3) == f"rank 3 (learner, host {socket.gethostname()}, pid {os.getpid()}, still running)"
    arrivals = Arrivals(store, "collectives/g", rank=1, world_size=4, ranks=[1, 3])
    arrivals.arrive()
    assert arrivals.missing() == [3]
    line = arrivals.explain("the reduction", 5, RuntimeError("Connection closed by peer"))
    assert line.startswith("the reduction failed (RuntimeError: Connection closed by peer)"), line
    assert line.endswith(
        f"; rank 3 (learner, host {socket.gethostname()}, pid {os.getpid()}, still running) had not reached it"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_settle_waits_for_a_rank_that_is_exiting_and_gives_up_on_one_that_runs() -> None:
    """After a broken connection the peer is often still exiting: ``settle`` waits until this host
    no longer sees it running (so the message says how it ended), and no longer than its bound."""
    from thundersync.engine.failures import settle

    store = dist.HashStore()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    store.set("thundersync/who/1", f"{socket.gethostname()} {child.pid}")
    try:
        assert whereabouts(store, 1).endswith(", still running")
        settle(store, [1], seconds=60)
        assert whereabouts(store, 1).endswith(", no longer running")
    finally:
        child.wait()
    introduce(store, 0)  # this process: it runs on
    start = time.monotonic()
    settle(store, [0], seconds=0.2)
    assert 0.2 <= time.monotonic() - start < 10
