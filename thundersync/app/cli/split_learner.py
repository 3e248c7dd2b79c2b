"""A split's learner ranks running a pipeline file (:mod:`thundersync.app.cli.split`, decisions
088, 090, 091, 094): one batch of the source stage per step.

Each learner rank streams its groups of each batch into the backward stage's objective
(:func:`~thundersync.split.learn_batch`): GRPO's, each trajectory closed with the reward its
rollout rank sent, or OPD's, each trajectory first scored on this learner rank by the teacher
stage's ``teacher`` (its log-prob of each generated token after the prompt, as the teacher stage
scores a one-process run's actions) and closed without a reward. It then steps the step stage's
``trainer`` (which reduces over the learners), tells its ``checkpointer`` and publishes its
``policy`` as the step stage does, gathers the learners' shares of the step metrics, and the
first learner rank writes the step's line and broadcasts the objective's trainable tensors.
Before the first batch it broadcasts them once (its policy clock's version: 0, or a resumed
run's step), so the rollout ranks start from its weights.

The step metrics see, for each received trajectory, the events a one-process run's stages would
have sent for it: its group's ``GroupOpened``, its ``ActionGenerated`` (tokens and behaviour
log-probs), its ``Rewarded`` (the reward its rollout rank sent: OPD does not train on it, the
line reports it, as a one-process OPD run's reward stage does) and, for OPD, its
``TeacherScored``, so a line has a one-process run's fields (``reverse_kl`` included).
"""

from __future__ import annotations

import functools
from time import perf_counter
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread

from thundersync.errors import ConfigError, PipelineError
from thundersync.events import ActionGenerated, BatchReady, GroupOpened, Rewarded, StepDone, TeacherScored
from thundersync.stages.source import SourceStage
from thundersync.stages.step import step_done

if TYPE_CHECKING:
    from thundersync.app.cli.split_stages import SplitParts
    from thundersync.app.metrics.jsonl import JsonlMetrics
    from thundersync.app.metrics.step_metrics import StepMetrics
    from thundersync.engine.split import SplitChannel, SplitTrajectory
    from thundersync.events import PromptSubmitted
    from thundersync.stages.teacher import Teacher

__all__ = ["learn"]


async def learn(channel: SplitChannel, parts: SplitParts, metrics: JsonlMetrics, steps: StepMetrics) -> int:
    """Run this learner rank to the end of the source's batches (module docstring); returns the
    steps taken."""
    from thundersync.app.metrics.step_metrics import merge_ranks
    from thundersync.split import learn_batch

    step, params = parts.step, parts.params
    if step.policy is not None:
        step.version = step.policy.version  # as the step stage: a resumed run counts on from the clock
    version = start = step.version
    _check_position(parts.source, version)
    await anyio.to_thread.run_sync(channel.broadcast_weights, params, version)
    for batch in parts.source.batches():
        batch_id = batch[0].batch_id
        seen = _Seen(parts.objective, steps, batch, version)
        teacher = None if parts.teacher is None else functools.partial(_score, parts.teacher)
        stream = functools.partial(learn_batch, channel, seen, version=version, teacher=teacher, observe=seen.observe)
        count = await anyio.to_thread.run_sync(stream)
        assert step.trainer is not None  # split_parts checked it
        result = await step.trainer.step(BatchReady(batch_id=batch_id, num_groups=len(batch), num_trajectories=count))
        version += 1
        step.version = version
        if step.checkpointer is not None:  # as the step stage: a step seen done has its checkpoint
            await step.checkpointer.stepped(version, batch_id)
        record = seen.record(step_done(batch_id, version, result))
        shares = await anyio.to_thread.run_sync(_gather_shares, channel, steps.share)
        metrics.write("step", **merge_ranks(record, shares))  # the first learner's sink alone writes
        if step.policy is not None:
            step.policy.publish(version)
        await anyio.to_thread.run_sync(channel.broadcast_weights, params, version)
    if step.checkpointer is not None:
        await step.checkpointer.finished(version)
    return version - start


def _score(teacher: Teacher, prompt: list[int], tokens: list[int]) -> list[float]:
    """The teacher's log-probs of ``tokens`` after ``prompt`` (learn_batch's worker thread asks
    the run's event loop, where an async teacher batches its requests)."""
    return anyio.from_thread.run(teacher.logprobs, prompt, tokens)


def _check_position(source: SourceStage, version: int) -> None:
    """The rollout ranks continue after the first ``version`` batches (what the learner's first
    broadcast tells them); refuse a resumed learner whose source skips other batches."""
    if source.skipped != frozenset(range(version)):
        consumed = sorted(source.skipped, key=str)
        shown = f"{consumed[:8]}{' ...' if len(consumed) > 8 else ''} ({len(consumed)} batches)"
        first = f"its first {version}, 0..{version - 1}" if version else "none"
        raise ConfigError(
            f"run.split: the learner resumed at step {version} with the source's batches {shown} consumed, not "
            f"{first}; the rollout ranks continue after the source's first {version} batches, so they would "
            "sample other batches than the learner steps on: resume this checkpoint without [run.split]"
        )


def _gather_shares(channel: SplitChannel, share: Any) -> list[Any]:
    """Every learner rank's part of the batch (its groups' rewards, tokens...), in learner order."""
    import torch.distributed as dist

    shares: list[Any] = [None] * len(channel.placement.learner)
    dist.all_gather_object(shares, share, group=channel.learner_group)
    return shares


class _Seen:
    """The objective, as :func:`learn_batch` calls it, telling the step metrics what it received
    (the events a one-process run's stages would have sent for it: module docstring)."""

    def __init__(self, objective: Any, steps: StepMetrics, batch: list[PromptSubmitted], version: int):
        self.objective, self.steps, self.version = objective, steps, version
        self.batch_id, self.groups = batch[0].batch_id, len(batch)
        self.prompts = {int(prompt.group_id): list(prompt.prompt_tokens) for prompt in batch}
        self.last: float | None = None
        self.started = perf_counter()  # the learner's wait for the batch begins

    def open_group(self, group_id: int, prompt: list[int]) -> None:
        if self.prompts.get(group_id) != prompt:  # the rollout ranks sample another batch than this one
            raise PipelineError(
                f"run.split: the learner received group {group_id} (prompt of {len(prompt)} tokens) for batch "
                f"{self.batch_id}, whose groups are {sorted(self.prompts)} with their prompts; the rollout ranks "
                "sampled another batch than the learner steps on (their source is not at the learner's position)"
            )
        self.objective.open_group(group_id, prompt)
        self.steps.observe(
            GroupOpened(group_id=group_id, prompt_tokens=prompt, batch_id=self.batch_id,
                        policy_version=self.version, groups_in_batch=self.groups)
        )  # fmt: skip

    def observe(self, trajectory: SplitTrajectory) -> None:
        """The trajectory's action (its tokens and behaviour log-probs) and the reward its rollout rank sent."""
        group_id, trajectory_id = trajectory.group_id, trajectory.trajectory_id
        self.steps.observe(
            ActionGenerated(group_id=group_id, trajectory_id=trajectory_id, turn=0, token_ids=trajectory.tokens,
                            behaviour_logprobs=trajectory.logprobs, final=True, policy_version=self.version)
        )  # fmt: skip
        self.steps.observe(Rewarded(group_id=group_id, trajectory_id=trajectory_id, reward=trajectory.reward))
        self.last = perf_counter()

    def append_turn(
        self, group_id: int, trajectory_id: int, tokens: list[int], scored: list[bool], **logprobs: list[float]
    ) -> None:
        """The objective's ``append_turn``; OPD's ``teacher_logprobs`` also go to the step metrics."""
        self.objective.append_turn(group_id, trajectory_id, tokens, scored, **logprobs)
        teacher = logprobs.get("teacher_logprobs")
        if teacher is not None:
            scores = TeacherScored(group_id=group_id, trajectory_id=trajectory_id, turn=0, teacher_logprobs=teacher)
            self.steps.observe(scores)

    def close_trajectory(self, group_id: int, trajectory_id: int, *reward: float) -> None:
        self.objective.close_trajectory(group_id, trajectory_id, *reward)

    def close_group(self, group_id: int) -> None:
        self.objective.close_group(group_id)

    def record(self, done: StepDone) -> dict[str, Any]:
        record = self.steps.observe(done)
        assert record is not None
        rollout = None if self.last is None else self.last - self.started
        return {**record, "rollout_s": rollout, "generator_idle_s": None}
