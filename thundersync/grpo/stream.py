"""RewardLinearBackward: the lossless streaming GRPO objective on a :class:`StreamingRun`.

For every group g with trajectories i (rewards r_i, advantages A_i from
:mod:`thundersync.grpo.estimators`) the run accumulates the gradient of

    J = sum_g sum_i A_i * S_i,      S_i = sum over scored tokens t of i of log pi(y_t | prompt, earlier tokens of i)

A trajectory is one branch after its group's prompt (all its turns in one chunk). Its gradient
g_i = grad S_i does not depend on any reward, so a closed branch can run before its group
closes: ready branches of an open group are packed by equal reward r and add G2 += g_pack,
G1 += (r - r0) g_pack (r0: the first such reward of the group), with the same pair of ledgers
for the adjoint of the prompt's K/V state (computed once, when the first such pack runs).
Branches still waiting when their group closes run with their final advantages as weights,
straight into the total: the last of those packs holds the prompt too, which is forwarded with
them and backpropagated once, through the graph for its own branches and with the combined
adjoint of all the others. At the group's close the total also receives c1 G1 + c2 G2
(:func:`~thundersync.grpo.estimators.accumulator_coefficients`). A group whose rewards are all
equal contributes exactly zero and its remaining work is skipped.

    >>> run = StreamingRun(model)                                              # doctest: +SKIP
    >>> grpo = RewardLinearBackward(run, eps=1e-6, estimator="grpo")            # doctest: +SKIP
    >>> grpo.open_group("g", prompt); grpo.append_turn("g", 0, ids, scored)    # doctest: +SKIP
    >>> grpo.close_trajectory("g", 0, 1.0); grpo.close_group("g")              # doctest: +SKIP
    >>> grpo.assert_safe_to_step(); optimizer.step()                           # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from thundersync.engine.run import StreamingRun
from thundersync.errors import ConfigError, StreamingError, UnknownIdError
from thundersync.grpo import _jobs
from thundersync.grpo.estimators import ESTIMATORS, Estimator, accumulator_coefficients, advantages, contributes

__all__ = ["RewardLinearBackward"]


@dataclass
class _Trajectory:
    branch: _jobs.Branch = field(default_factory=lambda: _jobs.Branch([], []))
    reward: float | None = None


@dataclass
class _Group:
    work: _jobs.GroupWork
    trajectories: dict[Hashable, _Trajectory] = field(default_factory=dict)
    waiting: list[_Trajectory] = field(default_factory=list)  # closed, scored, not yet submitted
    reference: float | None = None  # r0 of the G1 accumulator
    prompt_forwarded: bool = False

    def unclosed(self) -> list[Hashable]:
        return [tid for tid, t in self.trajectories.items() if t.reward is None]


class RewardLinearBackward:
    """Streams GRPO-family gradients (``estimator``: "grpo", "dr_grpo" or "rloo") into ``run``."""

    def __init__(self, run: StreamingRun, eps: float = 1e-6, estimator: Estimator = "grpo") -> None:
        if estimator not in ESTIMATORS:
            raise ConfigError(f"unknown estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
        if not eps >= 0:
            raise ConfigError(f"eps must be >= 0, got {eps}")
        self.run, self.eps, self.estimator = run, float(eps), estimator
        self._groups: dict[Hashable, _Group] = {}

    def open_group(self, group_id: Hashable, prompt_tokens: Any) -> None:
        """Open a group; its prompt is forwarded once, shared by its trajectories (never before needed)."""
        self.run.begin(self)
        if group_id in self._groups:
            raise StreamingError(f"group {group_id!r} is already open; close it before opening it again")
        self._groups[group_id] = _Group(_jobs.GroupWork(self.run.prompt_ids(group_id, prompt_tokens)))

    def append_turn(self, group_id: Hashable, trajectory_id: Hashable, tokens: Any, scored: Sequence[bool]) -> None:
        """Append a turn (policy turn: some tokens scored; observation turn: none)."""
        group = self.run.lookup_group(self._groups, group_id)
        trajectory = group.trajectories.get(trajectory_id)
        if trajectory is not None and trajectory.reward is not None:
            raise StreamingError(f"trajectory {trajectory_id!r} of group {group_id!r} is closed; cannot append to it")
        ids, flags = self.run.turn_ids(f"trajectory {trajectory_id!r} in group {group_id!r}", tokens, scored)
        if trajectory is None:
            trajectory = group.trajectories[trajectory_id] = _Trajectory()
        trajectory.branch.tokens += ids
        trajectory.branch.scored += flags

    def close_trajectory(self, group_id: Hashable, trajectory_id: Hashable, reward: float) -> None:
        """Close a trajectory with its reward; its backward may run now (packed with others)."""
        group = self.run.lookup_group(self._groups, group_id)
        trajectory = group.trajectories.get(trajectory_id)
        if trajectory is None:
            raise UnknownIdError(
                f"trajectory {trajectory_id!r} of group {group_id!r} has no turn; append a turn before closing it"
            )
        if trajectory.reward is not None:
            raise StreamingError(f"trajectory {trajectory_id!r} of group {group_id!r} is already closed")
        value = float(reward)
        if not math.isfinite(value):
            raise ConfigError(
                f"reward of trajectory {trajectory_id!r} in group {group_id!r} is {value}; rewards must be finite"
            )
        trajectory.reward = value
        if any(trajectory.branch.scored):
            group.waiting.append(trajectory)
            if sum(len(t.branch) for t in group.waiting) >= self.run.pack_tokens:
                self._submit_linear(group_id, group)

    def close_group(self, group_id: Hashable) -> None:
        """Close a group: every trajectory must be closed; its combined gradient joins the total."""
        group = self.run.lookup_group(self._groups, group_id)
        unclosed = group.unclosed()
        if unclosed:
            raise StreamingError(f"group {group_id!r} has unclosed trajectories {unclosed!r}; close them first")
        del self._groups[group_id]
        rewards = [t.reward for t in group.trajectories.values() if t.reward is not None]
        if not contributes(rewards, self.estimator):
            group.work.cancelled = True  # every advantage is exactly zero: skip the queued work
            self.run.submit(f"release of group {group_id!r}", group.work.release)
            return
        weights = advantages(rewards, self.estimator, self.eps)
        by_trajectory = {id(t): a for t, a in zip(group.trajectories.values(), weights)}
        items = [(group.work, t.branch, by_trajectory[id(t)]) for t in group.waiting]
        budget = max(self.run.pack_tokens - len(group.work.prompt), 0)
        packs = _packs(items, budget, key=lambda item: len(item[1])) if items else [[]]
        if len(packs) > 1:
            self._ensure_prompt_state(group_id, group)
        for pack in packs[:-1]:
            self.run.submit(
                f"final backward of {len(pack)} branches of group {group_id!r}",
                lambda pack=pack: _jobs.backward_final(self.run, pack),
            )
        reference = group.reference if group.reference is not None else 0.0
        c1, c2 = accumulator_coefficients(rewards, self.estimator, self.eps, reference)
        work, last = group.work, packs[-1]
        self.run.submit(
            f"close of group {group_id!r} with {len(last)} branches",
            lambda: _jobs.close_group(self.run, work, last, c1, c2),
        )

    def assert_safe_to_step(self) -> None:
        """Raise :class:`~thundersync.errors.UnsafeStepError` naming pending work; else ``.grad`` is final."""
        pending = []
        for gid, group in self._groups.items():
            unclosed = group.unclosed()
            detail = f" (unclosed trajectories: {unclosed!r})" if unclosed else ""
            pending.append(f"group {gid!r} is open{detail}")
        self.run.assert_safe_to_step(pending)

    def discard(self) -> None:
        """Abandon the logical batch (after a failure): drop every open group and the run's total.

        ``p.grad`` is left as it was before the batch (GRPO adds to it only at the step).
        """
        self._groups.clear()
        self.run.discard()

    def retained_bytes(self) -> int:
        """Bytes of tensors held for open groups plus the run's scratch and total."""
        self.run.worker.join()
        return self.run.retained_bytes() + sum(g.work.nbytes() for g in self._groups.values())

    def _ensure_prompt_state(self, group_id: Hashable, group: _Group) -> None:
        """Branches that run apart from the prompt read its K/V state: compute it once, first."""
        if not group.prompt_forwarded:
            group.prompt_forwarded = True
            work = group.work
            self.run.submit(f"prompt forward of group {group_id!r}", lambda: _jobs.forward_prompt(self.run, work))

    def _submit_linear(self, group_id: Hashable, group: _Group) -> None:
        self._ensure_prompt_state(group_id, group)
        if group.reference is None:
            group.reference = group.waiting[0].reward
        by_reward: dict[float, list[_jobs.Branch]] = {}
        for t in group.waiting:
            by_reward.setdefault(t.reward, []).append(t.branch)  # type: ignore[arg-type]
        group.waiting = []
        work, reference = group.work, group.reference
        assert reference is not None
        for reward, branches in by_reward.items():
            for pack in _packs(branches, self.run.pack_tokens, key=len):
                self.run.submit(
                    f"backward of {len(pack)} branches of group {group_id!r} (reward {reward})",
                    lambda pack=pack, delta=reward - reference: _jobs.backward_linear(self.run, work, pack, delta),
                )


def _packs(items: Sequence[Any], limit: int, *, key: Any) -> list[list[Any]]:
    """Consecutive runs of ``items`` holding at most ``limit`` tokens each (at least one item)."""
    packs: list[list[Any]] = []
    size = 0
    for item in items:
        if packs and size + key(item) <= limit:
            packs[-1].append(item)
            size += key(item)
        else:
            packs.append([item])
            size = key(item)
    return packs
