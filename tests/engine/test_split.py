"""The split's checks that need no second process: placements, and what the learner refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.engine.tiny_models import tiny_qwen3
from thundersync.engine.split import Placement, SplitChannel, SplitTrajectory
from thundersync.errors import ConfigError, DistributedError


def test_a_placement_names_each_rank_once_in_one_role() -> None:
    placement = Placement(rollout=(1, 2, 3), learner=(0,))
    assert [placement.role(rank) for rank in range(4)] == ["learner", "rollout", "rollout", "rollout"]
    assert placement.groups_of(2, [10, 11, 12, 13, 14]) == [11, 14]
    with pytest.raises(ConfigError, match="distinct"):
        Placement(rollout=(0, 1), learner=(1,))
    with pytest.raises(ConfigError, match="at least one rollout"):
        Placement(rollout=(), learner=(0,))
    two = Placement(rollout=(0, 2), learner=(1, 3))  # each rollout rank deals its groups over the learners
    assert [two.learner_of(position) for position in range(6)] == [1, 1, 3, 3, 1, 1]
    assert [placement.learner_of(position) for position in range(4)] == [0, 0, 0, 0]
    with pytest.raises(ConfigError, match="rank 5 is in neither role"):
        placement.role(5)


def test_a_placement_must_name_every_rank_of_the_world() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"names ranks \[0, 1\], the world has ranks 0..0"):
            SplitChannel(Placement(rollout=(1,), learner=(0,)))
    finally:
        dist.destroy_process_group()


class _Channel:
    """What learn_batch reads of a channel: the batch's trajectories."""

    def __init__(self, trajectories: list[SplitTrajectory]) -> None:
        self.trajectories = trajectories

    def receive(self) -> Any:
        return iter(self.trajectories)


def _trajectory(index: int, *, version: int = 0, size: int = 2) -> SplitTrajectory:
    return SplitTrajectory(
        group_id=0, trajectory_id=index, group_size=size, prompt=[1, 2], tokens=[3, 4], logprobs=[-1.0, -2.0],
        reward=float(index), policy_version=version,
    )  # fmt: skip


def _grpo() -> Any:
    import thundersync

    return thundersync.RewardLinearBackward(thundersync.StreamingRun(tiny_qwen3(torch.float64)))


def test_the_learner_refuses_a_trajectory_of_another_policy_version_and_an_incomplete_group() -> None:
    from thundersync.split import learn_batch

    with pytest.raises(DistributedError, match="generated on policy version 1, the learner is on version 0"):
        learn_batch(_Channel([_trajectory(0, version=1)]), _grpo(), version=0)  # type: ignore[arg-type]
    with pytest.raises(DistributedError, match=r"missing trajectories .*\{0: '1 of 2'\}"):
        learn_batch(_Channel([_trajectory(0)]), _grpo(), version=0)  # type: ignore[arg-type]
    with pytest.raises(DistributedError, match="says its group has 3 trajectories, an earlier one 2"):
        learn_batch(_Channel([_trajectory(0), _trajectory(1, size=3)]), _grpo(), version=0)  # type: ignore[arg-type]
    grpo = _grpo()
    assert learn_batch(_Channel([_trajectory(1), _trajectory(0)]), grpo, version=0) == 2  # type: ignore[arg-type]
    grpo.assert_safe_to_step()
