"""The rollout side of a rollout/learner split: generate this rank's groups and send each
trajectory to its group's learner rank as soon as it is finished
(:class:`~thundersync.engine.split.SplitChannel`).

    >>> version = 0
    >>> for prompts in batches:                                                      # doctest: +SKIP
    ...     await generate_batch(channel, generator, prompts, group_size=4, reward=score, version=version)
    ...     version = channel.receive_weights(list(model.parameters()))   # the learner's step, in place
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
import anyio.to_thread
import msgspec

from thundersync.engine.split import SplitChannel, SplitTrajectory
from thundersync.generation.base import GenerationRequest, Generator, SamplingParams

__all__ = ["generate_batch"]

Reward = Callable[[list[int], list[int]], float]
"""``reward(prompt, tokens)``: the reward of a trajectory that sampled ``tokens`` after ``prompt``."""


async def generate_batch(
    channel: SplitChannel,
    generator: Generator,
    prompts: Sequence[tuple[int, list[int]]],
    *,
    group_size: int,
    reward: Reward,
    version: int,
    params: SamplingParams | None = None,
    seed: Callable[[int, int], int] | None = None,
) -> int:
    """Generate ``group_size`` trajectories for each of this rank's groups of ``prompts`` (``(group_id,
    prompt token ids)`` pairs, the same list on every rollout rank: :meth:`Placement.groups_of`
    picks this rank's share), all at once, send each when it finishes to the learner rank of its
    group (:meth:`Placement.learner_of` the group's position in ``prompts``), then end the batch.
    ``seed(group_id, trajectory_id)`` fixes a request's sampling seed (default: the generator's).
    Returns how many trajectories this rank sent."""
    params = params or SamplingParams()
    placement = channel.placement
    mine = set(placement.groups_of(channel.rank, [group for group, _ in prompts]))
    sent = 0

    async def one(group: int, prompt: list[int], index: int, learner: int) -> None:
        nonlocal sent
        request_params = params if seed is None else msgspec.structs.replace(params, seed=seed(group, index))
        result = await generator.generate(GenerationRequest(prompt_ids=list(prompt), params=request_params))
        trajectory = SplitTrajectory(
            group_id=group,
            trajectory_id=index,
            group_size=group_size,
            prompt=list(prompt),
            tokens=list(result.token_ids),
            logprobs=list(result.logprobs),
            reward=float(reward(list(prompt), list(result.token_ids))),
            policy_version=version,
        )
        await anyio.to_thread.run_sync(channel.send, trajectory, learner)
        sent += 1

    try:
        async with anyio.create_task_group() as tasks:
            for position, (group, prompt) in enumerate(prompts):
                if group in mine:
                    for index in range(group_size):
                        tasks.start_soon(one, group, prompt, index, placement.learner_of(position))
    except BaseExceptionGroup as failures:  # one cause for the caller: the first failed request's
        raise _first(failures) from failures
    await anyio.to_thread.run_sync(channel.end_batch)
    return sent


def _first(failures: BaseExceptionGroup[BaseException]) -> BaseException:
    error: BaseException = failures
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
