"""The pool reuses sandboxes only after a verified reset and caps its members; many execs leave nothing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import anyio
import anyio.lowlevel
import pytest

from thundersync.errors import ConfigError, SandboxError
from thundersync.sandboxes import Sandbox, SandboxPool, SandboxPools, trees

pytestmark = pytest.mark.anyio


class FakeSandbox:
    """Just enough of a sandbox for the pool: counts what happens to it."""

    def __init__(self, log: list[str], reset_result: bool | Exception = True) -> None:
        self.name = f"fake{log.count('made')}"
        self.log = log
        self.reset_result = reset_result
        log.append("made")

    async def __aenter__(self) -> FakeSandbox:
        return self

    async def reset(self) -> bool:
        await anyio.lowlevel.checkpoint()
        if isinstance(self.reset_result, Exception):
            raise self.reset_result
        return self.reset_result

    async def close(self) -> None:
        self.log.append(f"closed {self.name}")


async def test_pool_reuses_a_sandbox_whose_reset_is_verified(
    new_sandbox: Callable[..., Sandbox], host_clean: Callable[[], Awaitable[None]]
) -> None:
    async with SandboxPool(new_sandbox, max_size=2) as pool:
        async with pool.acquire() as first:
            seed = trees.tree_digest(first.tree)
            await first.exec("echo junk > junk; rm README")
        async with pool.acquire() as second:
            assert second is first and trees.tree_digest(second.tree) == seed
        stats = pool.stats
        counts = (stats.created, stats.reused, stats.reset_ok, stats.discarded, stats.in_use, stats.idle)
        assert counts == (1, 1, 2, 0, 0, 1) and stats.takes == 2 and stats.resets == 2
    await host_clean()


@pytest.mark.parametrize("outcome", [False, RuntimeError("engine went away")])
async def test_pool_discards_a_sandbox_whose_reset_fails_or_raises(outcome: bool | Exception) -> None:
    log: list[str] = []
    async with SandboxPool(lambda: FakeSandbox(log, outcome), max_size=1) as pool:  # type: ignore[arg-type,return-value]
        async with pool.acquire():
            pass
        async with pool.acquire() as again:
            assert again.name == "fake1"  # a new one
    assert pool.stats.discarded == 2 and pool.stats.created == 2 and pool.stats.reused == 0
    assert log == ["made", "closed fake0", "made", "closed fake1"]


async def test_pool_never_has_more_than_max_size_members() -> None:
    log: list[str] = []
    busy = peak = 0

    async def task() -> None:
        nonlocal busy, peak
        async with pool.acquire():
            busy += 1
            peak = max(peak, busy)
            await anyio.sleep(0.01)
            busy -= 1

    async with SandboxPool(lambda: FakeSandbox(log), max_size=3) as pool:  # type: ignore[arg-type,return-value]
        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(task)
        assert peak == 3 and pool.stats.created == 3 and pool.stats.reused == 17
    assert sorted(x for x in log if x.startswith("closed")) == ["closed fake0", "closed fake1", "closed fake2"]
    with pytest.raises(SandboxError, match="the sandbox pool is closed"):
        async with pool.acquire():
            pass


async def test_fifty_concurrent_execs_across_ten_sandboxes_complete_and_leave_nothing(
    new_sandbox: Callable[..., Sandbox], host_clean: Callable[[], Awaitable[None]]
) -> None:
    outputs: dict[int, str] = {}
    with anyio.fail_after(120):
        async with AsyncExitStack() as stack:
            sandboxes: list[Sandbox] = []

            async def open_one() -> None:
                sandboxes.append(await stack.enter_async_context(new_sandbox()))

            async with anyio.create_task_group() as tg:
                for _ in range(10):
                    tg.start_soon(open_one)

            async def run(i: int) -> None:
                sandbox = sandboxes[i % 10]
                result = await sandbox.exec(f"echo {i} > out{i}; cat out{i}; cat README", timeout=60)
                assert result.exit_code == 0, result
                outputs[i] = result.stdout

            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(run, i)
    assert outputs == {i: f"{i}\nhello from the seed\n" for i in range(50)}
    await host_clean()


async def test_cancelling_an_exec_mid_run_kills_it_and_leaves_nothing(
    new_sandbox: Callable[..., Sandbox], host_clean: Callable[[], Awaitable[None]]
) -> None:
    async with new_sandbox() as sandbox:
        with anyio.move_on_after(0.5):
            await sandbox.exec("sleep 30 & sleep 30", timeout=60)
        result = await sandbox.exec("ps -o args", timeout=10)
        assert "sleep 30" not in result.stdout, result.stdout
    await host_clean()


async def test_pools_keyed_by_image_reuse_only_a_sandbox_of_the_same_image() -> None:
    made: list[tuple[str, FakeSandbox]] = []
    log: list[str] = []

    def make(image: object) -> FakeSandbox:
        made.append((str(image), FakeSandbox(log)))
        return made[-1][1]

    async with SandboxPools(make, max_size=4) as pools:
        a = await pools.take("a:1")
        await pools.put_back("a:1", a)
        b = await pools.take("b:1")
        assert b is not a and [image for image, _ in made] == ["a:1", "b:1"]
        await pools.put_back("b:1", b)
        assert await pools.take("a:1") is a and pools.stats.reused == 1


async def test_warm_sandboxes_start_on_entry_and_a_discarded_one_is_replaced() -> None:
    log: list[str] = []
    outcomes = iter([False, True, True, True])

    def make(image: object) -> FakeSandbox:
        return FakeSandbox(log, next(outcomes))

    async with SandboxPools(make, max_size=3, warm={"img": 2}) as pools:
        assert pools.stats.created == 2 and pools.stats.idle == 2
        first = await pools.take("img")
        await pools.put_back("img", first)  # its reset fails: closed, and a new one keeps the key warm
        assert pools.stats.discarded == 1 and pools.stats.created == 3 and pools.stats.idle == 2
    assert log.count("made") == 3 and sum(entry.startswith("closed") for entry in log) == 3


async def test_at_most_max_idle_sandboxes_wait_idle_the_oldest_is_closed() -> None:
    log: list[str] = []
    async with SandboxPools(lambda image: FakeSandbox(log), max_size=3, max_idle=1) as pools:  # type: ignore[arg-type,return-value]
        first, second = await pools.take("a"), await pools.take("b")
        await pools.put_back("a", first)
        await pools.put_back("b", second)
        assert pools.stats.idle == 1 and log[-1] == f"closed {first.name}"
        assert await pools.take("b") is second


def test_warm_counts_must_fit_the_pool() -> None:
    with pytest.raises(ConfigError, match=r"the warm sandboxes \(3\) must fit max_size and max_idle"):
        SandboxPools(lambda image: FakeSandbox([]), max_size=2, warm={"a": 3})  # type: ignore[arg-type,return-value]
