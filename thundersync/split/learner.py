"""The learner's side of a rollout/learner split: stream received trajectories into GRPO or OPD.

:func:`learn_batch` takes the trajectories a :class:`~thundersync.engine.split.SplitChannel`
receives, in the order they arrive, and streams each into the objective at once: a group opens
with its first trajectory, each trajectory is one turn of scored tokens (its behaviour log-probs
attached) and is then closed, and a group closes with its last trajectory. Then the caller steps
and broadcasts:

    >>> learn_batch(channel, grpo, version=n)                 # doctest: +SKIP
    >>> grpo.assert_safe_to_step(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
    >>> channel.broadcast_weights(grpo.run.params, n + 1)     # doctest: +SKIP

The objective is GRPO's :class:`~thundersync.grpo.stream.RewardLinearBackward` (each trajectory
closed with the reward its rollout rank sent), or, given a ``teacher``, an
:class:`~thundersync.opd.stream.OPDStream` (on-policy distillation, decision 094): this learner
rank scores each received trajectory's tokens with the teacher after its prompt, appends the turn
with those teacher log-probs and the behaviour log-probs, and closes it without a reward (OPD
takes none; the reward the rollout rank sent is only for ``observe``):

    >>> def teacher(prompt, tokens):                           # doctest: +SKIP
    ...     return anyio.from_thread.run(transformers_teacher.logprobs, prompt, tokens)
    >>> learn_batch(channel, opd, version=n, teacher=teacher)  # doctest: +SKIP
    >>> opd.assert_safe_to_step(); optimizer.step()            # doctest: +SKIP

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

from collections.abc import Callable
from typing import Any

from thundersync.engine.split import SplitChannel, SplitTrajectory
from thundersync.errors import DistributedError, PipelineError

__all__ = ["Score", "learn_batch"]

Score = Callable[[list[int], list[int]], list[float]]
"""``teacher(prompt, tokens)``: the teacher's log-prob of each of ``tokens`` after ``prompt`` and
the tokens before it (:meth:`~thundersync.stages.teacher.Teacher.logprobs`, called synchronously)."""


def learn_batch(
    channel: SplitChannel,
    objective: Any,
    *,
    version: int,
    teacher: Score | None = None,
    observe: Callable[[SplitTrajectory], None] | None = None,
) -> int:
    """Stream this learner rank's share of one batch from ``channel`` into ``objective`` (GRPO's
    streaming API, or OPD's with a ``teacher``: module docstring); return how many trajectories
    it received. Every trajectory must carry policy ``version`` (on policy: the version the
    learner's parameters hold) and every group must be complete when the batch ends (a group
    never spans learner ranks). ``observe(trajectory)`` sees each one after its group opened,
    before its turn goes in."""
    received: dict[int, int] = {}
    sizes: dict[int, int] = {}
    count = 0
    for trajectory in channel.receive():
        _check(trajectory, version, sizes)
        group = trajectory.group_id
        if group not in received:
            objective.open_group(group, trajectory.prompt)
            received[group], sizes[group] = 0, trajectory.group_size
        if observe is not None:
            observe(trajectory)
        if teacher is None:
            _rewarded(objective, trajectory)
        else:
            _distilled(objective, trajectory, teacher)
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


def _rewarded(objective: Any, trajectory: SplitTrajectory) -> None:
    """GRPO: the trajectory's tokens, all scored, with their behaviour log-probs; closed with its reward."""
    group = trajectory.group_id
    scored = [True] * len(trajectory.tokens)
    objective.append_turn(
        group, trajectory.trajectory_id, trajectory.tokens, scored, behaviour_logprobs=trajectory.logprobs
    )
    objective.close_trajectory(group, trajectory.trajectory_id, trajectory.reward)


def _distilled(objective: Any, trajectory: SplitTrajectory, teacher: Score) -> None:
    """OPD: the trajectory's tokens, all scored, with the teacher's log-probs of them after the
    prompt and their behaviour log-probs; closed without a reward."""
    group, tokens = trajectory.group_id, trajectory.tokens
    scores = list(teacher(list(trajectory.prompt), list(tokens)))
    if len(scores) != len(tokens):
        raise PipelineError(
            f"the teacher returned {len(scores)} log-probs for trajectory {trajectory.trajectory_id} of group "
            f"{group}, which has {len(tokens)} tokens; a teacher gives one log-prob per token it is asked to score"
        )
    scored = [True] * len(tokens)
    objective.append_turn(
        group,
        trajectory.trajectory_id,
        tokens,
        scored,
        teacher_logprobs=scores,
        behaviour_logprobs=trajectory.logprobs,
    )
    objective.close_trajectory(group, trajectory.trajectory_id)


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
