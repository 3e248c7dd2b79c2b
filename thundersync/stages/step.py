"""``type = "step"``: steps the optimizer on each ready batch and publishes the new policy.

Consumes: BatchReady. Produces: StepDone, then PolicyPublished. Waits for: the ``trainer``'s
step (without one it only counts versions, as in tests and dry runs). Unblocked by: close
announcing BatchReady.

Runtime objects: ``trainer``, any :class:`Trainer` (:class:`StreamingTrainer` puts the streaming
engine's safe-to-step check, clipping and the optimizer step behind it), and ``policy``, the
:class:`~thundersync.pipeline.policy.PolicyClock` that generate waits on.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import anyio
import msgspec

from thundersync.errors import ConfigError
from thundersync.events import BatchReady, EventBase, PolicyPublished, StepDone
from thundersync.pipeline.policy import PolicyClock
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.stages._objective import require_objective

if TYPE_CHECKING:
    import torch

    from thundersync.engine.objective import StreamingObjective

__all__ = ["StepResult", "StepStage", "StreamingTrainer", "Trainer"]


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one optimizer step reports: the total gradient norm before clipping."""

    grad_norm: float = 0.0


@runtime_checkable
class Trainer(Protocol):
    """Steps the optimizer on a batch whose work is all done, then syncs the generator."""

    async def step(self, ready: BatchReady) -> StepResult:
        """Check it is safe to step, clip, step; return once the new weights are live."""
        ...


class StreamingTrainer:
    """The :class:`Trainer` of a streaming objective (the backward stage's): one full-batch update.

    ``step`` waits for the objective's queued work and checks that nothing is pending
    (``assert_safe_to_step``: afterwards ``p.grad`` holds the batch's gradient), clips the total
    gradient norm to ``max_grad_norm`` (``None``: no clipping; the norm is reported either way),
    steps ``optimizer`` and sets the gradients to ``None``. A generator that shares the model
    (``TorchGenerator``) sees the new weights at once. The work runs in a worker thread.
    """

    def __init__(
        self, objective: StreamingObjective, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None
    ) -> None:
        require_objective(objective, "the trainer")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm is {max_grad_norm!r}; give a positive norm, or None for no clipping")
        self.objective = objective
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm

    async def step(self, ready: BatchReady) -> StepResult:
        return await anyio.to_thread.run_sync(self._step)

    def _step(self) -> StepResult:
        import torch

        self.objective.assert_safe_to_step()
        params = self.objective.run.params
        limit = math.inf if self.max_grad_norm is None else self.max_grad_norm
        norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm=norm)


class StepStage(Stage):
    """One optimizer step per BatchReady; the policy version counts steps."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = (BatchReady,)
    produces: ClassVar[tuple[type[EventBase], ...]] = (StepDone, PolicyPublished)

    def __init__(
        self,
        config: Stage.Config | None = None,
        /,
        *,
        trainer: Trainer | None = None,
        policy: PolicyClock | None = None,
    ) -> None:
        super().__init__(config)
        self.trainer = trainer
        self.policy = policy
        self.version = 0 if policy is None else policy.version

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        if self.policy is not None:
            self.version = self.policy.version  # a graph can run again: count on from the clock
        async for ready in inbox:
            assert isinstance(ready, BatchReady)
            result = StepResult() if self.trainer is None else await self.trainer.step(ready)
            self.version += 1
            await outbox.send(
                StepDone(batch_id=ready.batch_id, policy_version=self.version, grad_norm=result.grad_norm)
            )
            if self.policy is not None:
                self.policy.publish(self.version)
            await outbox.send(PolicyPublished(policy_version=self.version))
