"""The learner's side of a rollout/learner split: stream received trajectories into GRPO.

:func:`learn_batch` takes the trajectories a :class:`~thundersync.engine.split.SplitChannel`
receives, in the order they arrive, and streams each into a
:class:`~thundersync.grpo.stream.RewardLinearBackward` at once: a group opens with its first
trajectory, each trajectory is one turn of scored tokens (its behaviour log-probs attached) closed
with its reward, and a group closes with its last trajectory. Then the caller steps and broadcasts:

    >>> learn_batch(channel, grpo, version=n)                 # doctest: +SKIP
    >>> grpo.assert_safe_to_step(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
    >>> channel.broadcast_weights(grpo.run.params, n + 1)     # doctest: +SKIP

With several learner ranks each one learns the whole groups sent to it, and a
:class:`~thundersync.engine.sharded.ShardedDataParallel` (or, untested here, a replicated
:class:`~thundersync.engine.distributed.DataParallel`) over ``channel.learner_group`` reduces the
gradient once per batch; the first learner rank broadcasts the gathered weights:

    >>> dp = ShardedDataParallel(model, channel.learner_group, timeout_s=600)   # doctest: +SKIP
    >>> grpo = RewardLinearBackward(StreamingRun(model, data_parallel=dp))     # doctest: +SKIP
    >>> optimizer = torch.optim.AdamW(dp.parameters())                         # doctest: +SKIP
    >>> learn_batch(channel, grpo, version=n); grpo.assert_safe_to_step()      # doctest: +SKIP
    >>> dp.all_reduce_gradients(grpo.run.params); optimizer.step(); dp.stepped()  # doctest: +SKIP
    >>> optimizer.zero_grad(set_to_none=True)                                  # doctest: +SKIP
    >>> channel.broadcast_weights(list(model.parameters()), n + 1)             # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from thundersync.engine.split import SplitChannel, SplitTrajectory
from thundersync.errors import DistributedError

__all__ = ["learn_batch"]


def learn_batch(channel: SplitChannel, objective: Any, *, version: int) -> int:
    """Stream this learner rank's share of one batch from ``channel`` into ``objective`` (GRPO's
    streaming API); return how many trajectories it received. Every trajectory must carry policy
    ``version`` (on policy: the version the learner's parameters hold) and every group must be
    complete when the batch ends (a group never spans learner ranks)."""
    received: dict[int, int] = {}
    sizes: dict[int, int] = {}
    count = 0
    for trajectory in channel.receive():
        _check(trajectory, version, sizes)
        group = trajectory.group_id
        if group not in received:
            objective.open_group(group, trajectory.prompt)
            received[group], sizes[group] = 0, trajectory.group_size
        scored = [True] * len(trajectory.tokens)
        objective.append_turn(
            group, trajectory.trajectory_id, trajectory.tokens, scored, behaviour_logprobs=trajectory.logprobs
        )
        objective.close_trajectory(group, trajectory.trajectory_id, trajectory.reward)
        received[group] += 1
        count += 1
        if received[group] == sizes[group]:
            objective.close_group(group)
    short = {group: f"{n} of {sizes[group]}" for group, n in received.items() if n < sizes[group]}
    if short:
        raise DistributedError(
            f"the batch ended with groups missing trajectories (group: received of size): {short}; every rollout "
            "rank must send each trajectory of its groups before ending the batch"
        )
    return count


def _check(trajectory: SplitTrajectory, version: int, sizes: dict[int, int]) -> None:
    where = f"trajectory {trajectory.trajectory_id} of group {trajectory.group_id}"
    if trajectory.policy_version != version:
        raise DistributedError(
            f"{where} was generated on policy version {trajectory.policy_version}, the learner is on version "
            f"{version}: a rollout rank missed a weights broadcast"
        )
    known = sizes.get(trajectory.group_id)
    if known is not None and known != trajectory.group_size:
        raise DistributedError(
            f"{where} says its group has {trajectory.group_size} trajectories, an earlier one {known}"
        )
