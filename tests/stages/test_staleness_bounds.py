"""Bounded staleness and the bounds on what is in flight: a later batch's groups wait in the
backward stage until the step before them published their version, and nothing they hold
meanwhile may starve the batch being stepped (decision 082).

Here: the close stage gives a trajectory's sandbox back once its reward and its final action have
both come, in either order (they travel different edges), never only at its close, which for a
held batch waits for a whole optimizer step.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.stages.test_close import _final, _opened, _Runner
from thundersync.events import BackwardDone, Rewarded
from thundersync.pipeline import Graph, Pipeline
from thundersync.stages.close import CloseStage

pytestmark = pytest.mark.anyio


async def test_a_reward_that_comes_before_the_final_action_gives_the_sandbox_back_at_the_final_action() -> None:
    runner = _Runner()
    stage = CloseStage(CloseStage.Config(wait_for=("reward", "backward")), tools=runner)
    graph = Graph().add("close", stage, reads=["input"])
    async with Pipeline(graph) as pipeline, anyio.create_task_group() as group:

        async def feed() -> None:
            for event in (_opened(), Rewarded(group_id=0, trajectory_id=0, reward=1.0)):
                await pipeline.send(event)
            await anyio.sleep(0.05)
            assert not runner.released[0].is_set()  # its final action has not come here yet
            await pipeline.send(_final(0))
            with anyio.fail_after(5):  # held until the trajectory's backward, it would never come here
                await runner.released[0].wait()
            for event in (
                _final(1),
                Rewarded(group_id=0, trajectory_id=1, reward=0.0),
                BackwardDone(group_id=0, trajectory_id=0, turn=0),
                BackwardDone(group_id=0, trajectory_id=1, turn=0),
                BackwardDone(group_id=0),
            ):
                await pipeline.send(event)
            await pipeline.close()

        group.start_soon(feed)
        out: list[Any] = [event async for event in pipeline.results()]
    assert runner.released[1].is_set() and len(out) == 4
