"""A rank that hangs (alive, it reported no failure) is named by the others' step records' gather.

Two processes (``spawn``) join through :func:`~thundersync.app.cli.distributed.launch`, as
``torchrun`` would start them; rank 1 never comes to the gather, and rank 0's gather must end
within the timeout with one line naming rank 1, its host and pid, and what to do.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def _rank(rank: int, port: int, out: Any) -> None:
    os.environ.update(
        WORLD_SIZE="2",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        THUNDERSYNC_DIST_TIMEOUT_S="3",
    )
    from thundersync.app.cli.distributed import launch
    from thundersync.errors import DistributedError

    with launch(os.environ) as ranks:
        assert ranks is not None
        if rank == 1:
            out.put((1, str(os.getpid())))
            ranks.store.wait(["test/rank0-done"], datetime.timedelta(seconds=60))  # hangs past the timeout
            return
        started = time.monotonic()
        try:
            ranks.gather({"tokens": 3})
            out.put((0, "gathered"))
        except Exception as error:  # the test wants a DistributedError; another is shown as it is
            shown = str(error) if isinstance(error, DistributedError) else f"{type(error).__name__}: {error}"
            out.put((0, f"{shown} [after {time.monotonic() - started:.1f} s]"))
        ranks.store.set("test/rank0-done", b"1")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_a_rank_that_never_comes_to_the_step_records_gather_is_named_within_the_timeout() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, out)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    message, elapsed = results[0].rsplit(" [after ", 1)
    assert float(elapsed.removesuffix(" s]")) < 10
    assert message == (
        f"rank 0 of 2: rank 1 (host {socket.gethostname()}, pid {results[1]}, still running) did not reach the "
        "step records' gather within 3 s and reported no failure: hung, or slower than that; if the ranks "
        "are only slow, give them more time: THUNDERSYNC_DIST_TIMEOUT_S under `thundersync run` (seconds, "
        "default 600), timeout_s= in code"
    )
