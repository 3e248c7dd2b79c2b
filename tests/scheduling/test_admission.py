"""Admission bounds what is in flight, never deadlocks, and counts its decisions."""

from __future__ import annotations

import random

import anyio
import anyio.lowlevel
import pytest

from thundersync.errors import ConfigError
from thundersync.scheduling import Admission

pytestmark = pytest.mark.anyio


async def test_a_group_waits_for_a_slot_until_an_earlier_group_is_released() -> None:
    admission = Admission(max_groups=2)
    await admission.admit_group("a")
    await admission.admit_group("b")
    admitted = anyio.Event()

    async def third() -> None:
        await admission.admit_group("c")
        admitted.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(third)
        await anyio.sleep(0.05)
        assert not admitted.is_set()
        admission.release_group("a")
        with anyio.fail_after(1):
            await admitted.wait()
    stats = admission.stats()
    assert (stats.admitted, stats.released, stats.groups_in_flight, stats.peak_groups) == (3, 1, 2, 2)
    assert stats.waits == 1 and stats.waits_by_reason == {"max_groups": 1} and stats.waited_s > 0


async def test_reservations_of_younger_groups_wait_but_the_oldest_group_always_proceeds() -> None:
    admission = Admission(max_tokens=10)
    await admission.admit_group("old", tokens=4)
    await admission.admit_group("young", tokens=4)
    reserved = anyio.Event()

    async def young_wants_more() -> None:
        await admission.reserve_tokens("young", 5)
        reserved.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(young_wants_more)
        await anyio.sleep(0.05)
        assert not reserved.is_set()
        with anyio.fail_after(1):
            await admission.reserve_tokens("old", 8)  # over the bound, but it is the oldest
        assert admission.stats().tokens_in_flight == 16 and admission.stats().forced == 1
        admission.release_group("old")
        with anyio.fail_after(1):
            await reserved.wait()
    assert admission.stats().tokens_in_flight == 9


async def test_a_group_larger_than_the_token_bound_is_admitted_into_an_empty_pipeline() -> None:
    admission = Admission(max_tokens=8)
    with anyio.fail_after(1):
        await admission.admit_group("huge", tokens=100)
    assert admission.stats().forced == 1


async def test_the_memory_budget_holds_new_groups_until_memory_falls() -> None:
    allocated = [200]
    admission = Admission(gpu_memory_bytes=100, memory_probe=lambda: allocated[0])
    await admission.admit_group("first")  # alone: admitted whatever the reading
    admitted = anyio.Event()

    async def second() -> None:
        await admission.admit_group("second")
        admitted.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(second)
        await anyio.sleep(0.1)
        assert not admitted.is_set()
        allocated[0] = 50  # memory freed without any release
        with anyio.fail_after(1):
            await admitted.wait()
    assert admission.stats().waits_by_reason == {"gpu_memory_bytes": 1}


async def test_sandbox_slots_bound_concurrent_tool_calls() -> None:
    admission = Admission(sandbox_slots=2)
    running = peak = 0

    async def call() -> None:
        nonlocal running, peak
        async with admission.sandbox_slot():
            running += 1
            peak = max(peak, running)
            await anyio.sleep(0.01)
            running -= 1

    async with anyio.create_task_group() as tasks:
        for _ in range(6):
            tasks.start_soon(call)
    assert peak == 2 and admission.stats().waits_by_reason["sandbox_slots"] >= 1


async def test_bounds_hold_under_a_long_tailed_load() -> None:
    """Many groups with lognormal lengths, generated token by token: no bound is ever exceeded
    except by the oldest group, and every group finishes."""
    rng = random.Random(7)
    admission = Admission(max_groups=4, max_tokens=400)
    lengths = [min(int(rng.lognormvariate(3, 1)), 300) + 1 for _ in range(40)]
    finished: list[int] = []

    async def group(index: int) -> None:
        await admission.admit_group(index, tokens=10)
        for _ in range(lengths[index]):
            await admission.reserve_tokens(index, 1)
            stats = admission.stats()
            assert stats.groups_in_flight <= 4
            assert stats.tokens_in_flight <= 400 or next(iter(admission._tokens)) == index
            await anyio.lowlevel.checkpoint()
        admission.release_group(index)
        finished.append(index)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            for index in range(len(lengths)):
                tasks.start_soon(group, index)
    assert sorted(finished) == list(range(40))
    stats = admission.stats()
    assert stats.peak_groups == 4 and stats.groups_in_flight == 0 and stats.tokens_in_flight == 0


async def test_misuse_is_refused_with_the_value() -> None:
    admission = Admission(max_groups=1)
    await admission.admit_group("g")
    with pytest.raises(ConfigError, match="group 'g' is already admitted"):
        await admission.admit_group("g")
    with pytest.raises(ConfigError, match="group 'x' is not admitted; admit_group"):
        await admission.reserve_tokens("x", 1)
    with pytest.raises(ConfigError, match="tokens must be a non-negative int, got -1"):
        await admission.reserve_tokens("g", -1)
    admission.release_group("g")
    with pytest.raises(ConfigError, match="released twice"):
        admission.release_group("g")


def test_invalid_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="invalid admission settings: .*max_groups"):
        Admission(max_groups=0)
    with pytest.raises(ConfigError, match="invalid admission settings: .*unknown field `max_group`"):
        Admission(max_group=3)


async def test_a_sandbox_slot_is_held_by_a_trajectory_until_it_is_released() -> None:
    admission = Admission(sandbox_slots=2)
    await admission.hold_sandbox_slot(("g", 0))
    await admission.hold_sandbox_slot(("g", 1))
    with pytest.raises(ConfigError, match=r"\('g', 0\) already holds a sandbox slot; release it first"):
        await admission.hold_sandbox_slot(("g", 0))
    with anyio.move_on_after(0.05) as waited:
        await admission.hold_sandbox_slot(("g", 2))
    assert waited.cancelled_caught and admission.stats().sandbox_holders == 2
    admission.release_sandbox_slot(("g", 0))
    admission.release_sandbox_slot(("g", 0))  # a second release gives back nothing
    with anyio.fail_after(1):
        await admission.hold_sandbox_slot(("g", 2))
    stats = admission.stats(reset_peaks=True)
    assert (stats.sandbox_holders, stats.peak_sandbox_holders) == (2, 2)


async def test_without_a_bound_sandbox_slots_are_counted_but_never_wait() -> None:
    admission = Admission()
    for t in range(50):
        await admission.hold_sandbox_slot(t)
    assert admission.stats().sandbox_holders == 50
