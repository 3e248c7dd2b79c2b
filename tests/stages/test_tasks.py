"""A stage whose concurrent tasks fail raises the first real cause, never an ExceptionGroup."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from thundersync.errors import StageFailed
from thundersync.events import ActionGenerated, GroupOpened
from thundersync.stages._tasks import task_group
from thundersync.stages.reward import RewardStage

pytestmark = pytest.mark.anyio


class _AllFailTogether:
    """Waits until ``n`` scorings are in flight, then every one raises ValueError at once."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.waiting = 0
        self.ready = anyio.Event()

    async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> float:
        self.waiting += 1
        if self.waiting == self.n:
            self.ready.set()
        await self.ready.wait()
        raise ValueError(f"no <answer> in completion {completion_ids}")


async def test_concurrent_scorer_failures_name_the_first_value_error_and_its_event(
    run_stage: Callable[..., Any],
) -> None:
    events: list[Any] = [GroupOpened(group_id=0, prompt_tokens=[1], trajectory_ids=[0, 1, 2])]
    events += [ActionGenerated(group_id=0, trajectory_id=t, turn=0, token_ids=[10 + t], final=True) for t in range(3)]
    stage = RewardStage(RewardStage.Config(concurrency=3), scorer=_AllFailTogether(3))
    with pytest.raises(
        StageFailed,
        match=r"failed: ValueError: no <answer> in completion \[10\] "
        r"\(while handling ActionGenerated\(group_id=0, trajectory_id=0, .*\)\)$",
    ) as info:
        await run_stage(stage, events)
    cause = info.value.__cause__
    assert isinstance(cause, ValueError)
    assert cause.__notes__ == [
        "also raised in the same stage: ValueError: no <answer> in completion [11]",
        "also raised in the same stage: ValueError: no <answer> in completion [12]",
    ]


async def test_an_error_raised_while_being_cancelled_is_not_the_cause() -> None:
    async def consequence() -> None:
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            raise RuntimeError("channel closed under me") from None  # from None keeps __context__

    async def cause() -> None:
        await anyio.sleep(0.01)
        raise ValueError("the real failure")

    with pytest.raises(ValueError, match=r"^the real failure") as info:
        async with task_group() as group:
            group.start_soon(consequence)
            group.start_soon(cause)
    assert info.value.__notes__ == ["also raised in the same stage: RuntimeError: channel closed under me"]


async def test_a_consequence_listed_first_still_yields_the_cause() -> None:
    """Only the order of the group differs from the previous test: the cause is still raised."""

    async def body() -> None:
        try:
            try:
                raise anyio.get_cancelled_exc_class()()
            except BaseException:
                raise RuntimeError("closed") from None
        except RuntimeError as secondary:
            raise ExceptionGroup("two", [secondary, ValueError("real")]) from None

    with pytest.raises(ValueError, match=r"^real"):
        async with task_group() as group:
            group.start_soon(body)


async def test_only_cancellations_propagate_unchanged() -> None:
    with anyio.move_on_after(0.01) as scope:
        async with task_group() as group:
            group.start_soon(anyio.sleep_forever)
    assert scope.cancelled_caught
