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


def test_the_learner_scores_each_trajectory_with_the_teacher_and_streams_it_into_opd() -> None:
    """With a teacher, each trajectory's tokens are scored after its prompt and streamed into OPD
    with its behaviour log-probs: the gradient equals the dense OPD gradient of those inputs (fp64,
    < 1e-10); a teacher that returns another count of log-probs is refused naming the trajectory."""
    import thundersync
    from thundersync.errors import PipelineError
    from thundersync.opd import dense
    from thundersync.split import learn_batch

    calls: list[tuple[list[int], list[int]]] = []

    def teacher(prompt: list[int], tokens: list[int]) -> list[float]:
        calls.append((prompt, tokens))
        return [-0.3 * token - 0.1 * len(prompt) - 0.05 * i for i, token in enumerate(tokens)]

    model = tiny_qwen3(torch.float64)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model))
    sent = [
        SplitTrajectory(group_id=0, trajectory_id=i, group_size=2, prompt=[1, 2], tokens=tokens,
                        logprobs=[-1.0 - 0.1 * i - 0.2 * j for j in range(len(tokens))], reward=9.0, policy_version=0)
        for i, tokens in enumerate([[3, 4, 5], [6, 7]])
    ]  # fmt: skip
    assert learn_batch(_Channel(sent), opd, version=0, teacher=teacher) == 2  # type: ignore[arg-type]
    opd.assert_safe_to_step()
    assert calls == [([1, 2], [3, 4, 5]), ([1, 2], [6, 7])]

    def turn(t: SplitTrajectory) -> dense.DenseTurn:
        q = torch.tensor(teacher(t.prompt, t.tokens), dtype=torch.float64)
        return dense.DenseTurn(t.tokens, list(range(len(t.tokens))), q, torch.tensor(t.logprobs, dtype=torch.float64))

    kept = [dense.DenseTrajectory(t.prompt, [turn(t)]) for t in sent]
    want = dense.dense_gradient(model, opd.run.params, kept, 5.0)  # token_mean: the batch's 5 scored tokens
    got = [p.grad for p in opd.run.params]
    error = sum(float((g - w).pow(2).sum()) for g, w in zip(got, want, strict=True)) ** 0.5
    assert error / sum(float(w.pow(2).sum()) for w in want) ** 0.5 < 1e-10
    with pytest.raises(
        PipelineError,
        match=r"^the teacher returned 1 log-probs for trajectory 0 of group 0, which has 3 tokens; a teacher gives "
        r"one log-prob per token it is asked to score$",
    ):
        learn_batch(_Channel(sent), _opd(), version=0, teacher=lambda prompt, tokens: [0.0])  # type: ignore[arg-type]


def _opd() -> Any:
    import thundersync

    return thundersync.OPDStream(thundersync.StreamingRun(tiny_qwen3(torch.float64)))
