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
