"""The streaming-objective contract: what the backward stage and the trainer call.

A streaming objective turns a logical batch of trajectories into ``p.grad`` of its model while
the trajectories are still being generated. GRPO (:class:`~thundersync.RewardLinearBackward`) and
OPD (:class:`~thundersync.OPDStream`) implement it; the stages and
:class:`~thundersync.StreamingTrainer` are typed against it, never against either class.

The calls of one logical batch, in any interleaving across groups and trajectories::

    objective.open_group(g, prompt_tokens)
    objective.append_turn(g, t, action_ids, scored, teacher_logprobs=q)     # q: OPD only
    objective.append_turn(g, t, observation_ids, [False] * n)              # context, never scored
    objective.close_trajectory(g, t, reward=r)                             # r: GRPO only
    objective.close_group(g)
    objective.assert_safe_to_step()        # raises naming what is pending; else .grad is final
    optimizer.step()

``discard()`` abandons the batch after a failure and gives ``p.grad`` back what it held before.

Each implementation requires its own signal and refuses the other's with a
:class:`~thundersync.errors.ConfigError`: GRPO needs ``reward`` at ``close_trajectory`` and takes
no log-probs; OPD needs ``teacher_logprobs`` on turns with scored tokens and takes no reward.
Every argument is validated before any work is queued (:mod:`thundersync.engine.inputs`).

Who owns what: the objective owns everything the engine needs about a trajectory (its tokens,
whether it is closed, its queued work); the pipeline's tracker owns the graph's gating; the
backward stage only reorders events into these calls and keeps no copy of either.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from thundersync.engine.run import StreamingRun

__all__ = ["Signal", "StreamingObjective"]

Signal = Literal["reward", "teacher"]
"""What an objective waits for: a trajectory's reward (GRPO closes it then) or an action's
teacher log-probs (OPD backpropagates the action then)."""


@runtime_checkable
class StreamingObjective(Protocol):
    """One logical batch at a time, streamed into the parameters of ``run``'s model."""

    @property
    def run(self) -> StreamingRun:
        """The run whose model, parameters and worker the objective's work uses."""
        ...

    @property
    def signal(self) -> Signal:
        """``"reward"`` (close_trajectory needs ``reward``) or ``"teacher"`` (scored turns need
        ``teacher_logprobs``)."""
        ...

    def open_group(self, group_id: Hashable, prompt_tokens: Any) -> None:
        """Open a group; its prompt is computed once and shared by its trajectories."""
        ...

    def append_turn(
        self,
        group_id: Hashable,
        trajectory_id: Hashable,
        tokens: Any,
        scored: Sequence[bool],  # one flag per token (a 1-D bool tensor also does)
        *,
        teacher_logprobs: Any = None,
        behaviour_logprobs: Any = None,
    ) -> None:
        """Append a turn of a trajectory: an action (some tokens scored) or an observation (none)."""
        ...

    def close_trajectory(self, group_id: Hashable, trajectory_id: Hashable, reward: float | None = None) -> None:
        """No more turns for this trajectory; its remaining backward may run now (``reward``: GRPO only)."""
        ...

    def close_group(self, group_id: Hashable) -> None:
        """Every trajectory of the group is closed; the prompt's backward runs once."""
        ...

    def assert_safe_to_step(self) -> None:
        """Wait for queued work; raise :class:`~thundersync.errors.UnsafeStepError` naming what is
        pending, else leave the batch's gradient in ``p.grad`` and end the batch."""
        ...

    def discard(self) -> None:
        """Abandon the batch: drop its open groups and queued work, restore ``p.grad``."""
        ...
