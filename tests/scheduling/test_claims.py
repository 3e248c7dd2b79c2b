"""Ranks claim every group of a batch exactly once through the store, and seal it together."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import random
import time
from typing import Any

import pytest
import torch.distributed as dist

from thundersync.errors import ConfigError, DistributedError
from thundersync.scheduling import GroupClaims


def _master() -> Any:
    """A store served by the test process on a free port; ranks connect to it as clients."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))


def _rank_main(rank: int, world_size: int, port: int, durations: list[float], out: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    claims = GroupClaims(store, rank=rank, world_size=world_size, timeout_s=30)
    if store.add("test/ready", 1) == world_size:  # start together: process start-up times differ
        store.set("test/go", b"1")
    store.wait(["test/go"])
    for batch in (0, 1):
        mine = []
        while (index := claims.claim(batch, len(durations))) is not None:
            time.sleep(durations[index] * (1 + rank))  # rank 0 is the fastest: it should take most
            mine.append(index)
            claims.close(batch, index, len(durations))
        claims.wait_sealed(batch)
        claims.finish(batch)
        out.put((rank, batch, mine))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_group_is_claimed_once_and_faster_ranks_take_more(world_size: int) -> None:
    store = _master()
    keys_before = store.num_keys()
    rng = random.Random(world_size)
    durations = [rng.choice([0.02, 0.05, 0.1]) for _ in range(12)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, store.port, durations, out)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    claims = [out.get(timeout=60) for _ in range(2 * world_size)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for batch in (0, 1):
        taken = sorted(i for _, b, mine in claims if b == batch for i in mine)
        assert taken == list(range(12)), f"batch {batch}: claims {taken}"
    taken_by = {rank: len(mine) for rank, batch, mine in claims if batch == 1}
    assert taken_by[0] > taken_by[world_size - 1], f"rank 0 is the fastest but took less: {taken_by}"
    store.delete_key("test/ready")
    store.delete_key("test/go")
    assert store.num_keys() == keys_before, "the batches' claim keys were left in the store"


def test_a_batch_that_never_seals_times_out_naming_the_batch_and_the_count() -> None:
    store = _master()
    claims = GroupClaims(store, rank=0, world_size=1, timeout_s=0.2)
    assert [claims.claim("b7", 3), claims.claim("b7", 3)] == [0, 1]
    claims.close("b7", 0, 3)
    with pytest.raises(
        DistributedError,
        match=r"rank 0: batch 'b7' was not sealed within 0.2 s: 1 groups closed; rank 0 holds unclosed groups \[1\]; "
        r"no rank reported a cause",
    ):
        claims.wait_sealed("b7")


def test_claims_beyond_the_batch_return_none_and_extra_closes_are_refused() -> None:
    store = _master()
    claims = GroupClaims(store, rank=0, world_size=1)
    assert [claims.claim(0, 2), claims.claim(0, 2), claims.claim(0, 2)] == [0, 1, None]
    assert claims.close(0, 0, 2) is False and claims.close(0, 1, 2) is True
    claims.wait_sealed(0)
    with pytest.raises(DistributedError, match="batch 0 has 2 groups but 3 closes were counted"):
        claims.close(0, 1, 2)
    with pytest.raises(ConfigError, match="rank 0 closes group 5 of batch 0, which it never claimed"):
        claims.close(0, 5, 2)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="rank 2 is outside 0..1"):
        GroupClaims(object(), rank=2, world_size=2)
    with pytest.raises(ConfigError, match="groups_in_batch must be >= 1, got 0"):
        GroupClaims(object(), rank=0, world_size=1).claim(0, 0)
