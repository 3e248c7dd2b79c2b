"""``type = "step"``: steps the optimizer on each ready batch and publishes the new policy.

Consumes: BatchReady. Produces: StepDone, then PolicyPublished. Waits for: the ``trainer``'s
step (without one it only counts versions, as in tests and dry runs). Unblocked by: close
announcing BatchReady.

Runtime objects: ``trainer``, any :class:`Trainer` (:class:`StreamingTrainer` puts the streaming
engine's safe-to-step check, clipping and the optimizer step behind it), ``policy``, the
:class:`~thundersync.pipeline.policy.PolicyClock` that generate waits on, and ``checkpointer``,
any :class:`Checkpointer` (:class:`thundersync.app.checkpoints.checkpoint.Checkpointer`): it is told of each
step after the optimizer step and before StepDone is sent and the policy published (a step the
application sees done has its checkpoint, if one was due), and of the end of the stream.
"""

from __future__ import annotations

import math
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import anyio
import msgspec

from thundersync.errors import ConfigError
from thundersync.events import BatchReady, EventBase, Id, PolicyPublished, StepDone
from thundersync.pipeline.policy import PolicyClock
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.stages._objective import require_objective

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from thundersync.engine.objective import StreamingObjective

__all__ = [
    "AuditsGradient",
    "Checkpointer",
    "ReportsLogprobMismatch",
    "StepResult",
    "StepStage",
    "StreamingTrainer",
    "Trainer",
    "step_done",
]


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one optimizer step reports (copied into :class:`~thundersync.events.StepDone`).

    ``grad_norm``: the total gradient norm before clipping; ``learn_s``: seconds spent waiting for
    the engine's queued work plus the optimizer step; ``lr``: the learning rate of the step (first
    parameter group); ``logprob_mismatch``: mean |behaviour - learner| log-prob over the batch's
    scored tokens, ``None`` when the objective does not report it; ``audit_rel_error``:
    ``||g_stream - g_dense|| / ||g_dense||`` on an audited step (``audit_every``), else ``None``;
    ``objective_stats``: the objective's own statistics of the batch (the importance weights of a
    staleness-correcting loss form: ``is_mean``, ``is_max``, ``is_clip_fraction``, ``is_count``),
    ``None`` when it reports none.
    """

    grad_norm: float = 0.0
    learn_s: float = 0.0
    lr: float | None = None
    logprob_mismatch: float | None = None
    audit_rel_error: float | None = None
    objective_stats: dict[str, float] | None = None


@runtime_checkable
class Trainer(Protocol):
    """Steps the optimizer on a batch whose work is all done, then syncs the generator."""

    async def step(self, ready: BatchReady) -> StepResult:
        """Check it is safe to step, clip, step; return once the new weights are live."""
        ...


@runtime_checkable
class ReportsLogprobMismatch(Protocol):
    """An objective that measures the train/inference mismatch of the batch it accumulated."""

    def take_logprob_mismatch(self) -> float | None:
        """Mean |behaviour - learner| log-prob over the scored tokens since the last call, then reset.

        ``None`` when no scored token was seen.
        """
        ...


@runtime_checkable
class ReportsObjectiveStats(Protocol):
    """An objective with statistics of its own per batch (a GRPO loss form's importance weights)."""

    def take_objective_stats(self) -> dict[str, float] | None:
        """The statistics since the last call, then reset; ``None`` when there are none."""
        ...


@runtime_checkable
class AuditsGradient(Protocol):
    """An objective that can recompute its batch's gradient densely (the exactness audit)."""

    def keep_batch(self, keep: bool) -> None:
        """Keep (``True``) or stop keeping the plain inputs of the batch work that arrives from now on."""
        ...

    def dense_gradient(self) -> list[torch.Tensor]:
        """The kept batch's gradient through the model's ordinary forward, one tensor per
        ``run.params``; then the record starts empty."""
        ...


@runtime_checkable
class Checkpointer(Protocol):
    """Saves the training state at step boundaries (when to save is its own business)."""

    async def stepped(self, step: int, batch_id: Id) -> None:
        """Step ``step`` (counted from 1 over all runs) consumed batch ``batch_id``; weights are final."""
        ...

    async def finished(self, step: int) -> None:
        """The stream ended after step ``step``: save the last state if it is not saved yet."""
        ...


class StreamingTrainer:
    """The :class:`Trainer` of a streaming objective (the backward stage's): one full-batch update.

    ``step`` waits for the objective's queued work and checks that nothing is pending
    (``assert_safe_to_step``: afterwards ``p.grad`` holds the batch's gradient), clips the total
    gradient norm to ``max_grad_norm`` (``None``: no clipping; the norm is reported either way),
    steps ``optimizer``, then ``scheduler`` (an LR scheduler, stepped once per optimizer step; the
    reported ``lr`` is the one the step used) and sets the gradients to ``None``. When the run is
    one rank of several (``StreamingRun(..., data_parallel=...)``), the ranks' gradients are summed
    first, so every replica steps on the full batch's gradient; give ZeRO-1 as ``optimizer``
    (``torch.distributed.optim.ZeroRedundancyOptimizer``) to shard its state. With a sharded
    learner (:class:`~thundersync.engine.sharded.ShardedDataParallel`, the optimizer over its
    ``parameters()``) the summed gradient is reduce-scattered into the shards, clipped by the norm
    over every rank's shard, and the new parameters are gathered after the step. A generator that
    shares the model (``TorchGenerator``) sees the new weights at once. The work runs in a worker
    thread. An objective that is a :class:`ReportsLogprobMismatch` has its mismatch reported in
    the result.

    ``audit_every = N`` (0: never) audits every N-th step: the objective (an
    :class:`AuditsGradient`) keeps that batch's inputs, and before the optimizer step the trainer
    recomputes the batch's gradient densely and reports ``||g_stream - g_dense|| / ||g_dense||``
    as ``audit_rel_error`` (about 1e-6 in fp32, 1e-3 in bf16; anything near 1 is a bug). The dense
    pass costs about one forward and backward of the batch. With data parallelism each rank
    checks its own groups, before the gradients are summed.
    """

    def __init__(
        self,
        objective: StreamingObjective,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        audit_every: int = 0,
    ) -> None:
        require_objective(objective, "the trainer")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm is {max_grad_norm!r}; give a positive norm, or None for no clipping")
        if audit_every < 0:
            raise ConfigError(f"audit_every is {audit_every}; give a step count >= 1, or 0 for no audit")
        if audit_every and not isinstance(objective, AuditsGradient):
            raise ConfigError(
                f"audit_every={audit_every} needs an objective that can recompute its gradient densely "
                f"(keep_batch, dense_gradient); {type(objective).__name__} cannot: set audit_every = 0"
            )
        self.objective = objective
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.scheduler = scheduler
        self.audit_every = audit_every
        self._steps = 0
        self._keep_next_batch()

    async def step(self, ready: BatchReady) -> StepResult:
        return await anyio.to_thread.run_sync(self._step)

    def _step(self) -> StepResult:
        import torch

        start = perf_counter()
        self.objective.assert_safe_to_step()
        self._steps += 1
        audit = self._audit() if self.audit_every and self._steps % self.audit_every == 0 else None
        params = self.objective.run.params
        data_parallel = self.objective.run.data_parallel
        limit = math.inf if self.max_grad_norm is None else self.max_grad_norm
        if data_parallel is not None:  # each rank holds its groups' part: sum to the full batch's
            data_parallel.all_reduce_gradients(params)
            norm = data_parallel.clip_grad_norm(params, limit)
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
        lr = _learning_rate(self.optimizer)
        self._optimizer_step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if data_parallel is not None:
            data_parallel.stepped()  # a sharded learner gathers the new parameters
        objective = self.objective
        mismatch = objective.take_logprob_mismatch() if isinstance(objective, ReportsLogprobMismatch) else None
        stats = objective.take_objective_stats() if isinstance(objective, ReportsObjectiveStats) else None
        self._keep_next_batch()
        return StepResult(
            grad_norm=norm,
            learn_s=perf_counter() - start,
            lr=lr,
            logprob_mismatch=mismatch,
            audit_rel_error=audit,
            objective_stats=stats,
        )

    def _optimizer_step(self) -> None:
        """``optimizer.step()`` under the model's :func:`~thundersync.model.anatomy.adapter_lock`,
        which a :class:`~thundersync.generation.TorchGenerator` over the same model holds for each
        batcher step, so a decode step never reads half-updated weights. When such a generator
        decodes across the step (``allow_weight_changes()``: partial rollouts, which the generate
        and agent-app stages turn on for a clock with ``max_staleness >= 1``), the device is also
        synchronized inside the lock, on CUDA, before the step (the decode step in flight ends on
        the old weights) and after it (the next one reads every write). Otherwise (no generator over
        the model was allowed weight changes: ``max_staleness = 0``) no decode step runs during the
        step and nothing is waited for: a later request waits for the stream its ``generate`` was
        called from, where the step's work went first."""
        from thundersync.model.anatomy import adapter_lock, decoded_across_steps

        run = self.objective.run
        anatomy = getattr(run, "anatomy", None)  # a StreamingRun's; a test's stand-in may have none
        if anatomy is None:
            self.optimizer.step()
            return
        with adapter_lock(anatomy.model):
            across = decoded_across_steps(anatomy.model)
            if across:
                _synchronize(run.params)
            self.optimizer.step()
            if across:
                _synchronize(run.params)

    def _keep_next_batch(self) -> None:
        """Tell an auditing objective whether the next batch (step ``self._steps + 1``) is audited."""
        if self.audit_every and isinstance(self.objective, AuditsGradient):
            self.objective.keep_batch((self._steps + 1) % self.audit_every == 0)

    def _audit(self) -> float:
        """``||g_stream - g_dense|| / ||g_dense||`` of the batch whose gradient ``p.grad`` holds."""
        from thundersync.engine.dense import relative_error

        assert isinstance(self.objective, AuditsGradient)
        dense = self.objective.dense_gradient()
        return relative_error([p.grad for p in self.objective.run.params], dense)


def _synchronize(params: Sequence[torch.Tensor]) -> None:
    """Wait for the device of ``params`` to finish its queued work (CUDA; nothing to wait for elsewhere)."""
    import torch

    if params and params[0].device.type == "cuda":
        torch.cuda.synchronize(params[0].device)


def _learning_rate(optimizer: torch.optim.Optimizer) -> float | None:
    """The first parameter group's learning rate (None: an optimizer without ``param_groups``)."""
    groups = getattr(optimizer, "param_groups", None)
    return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None


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
        checkpointer: Checkpointer | None = None,
    ) -> None:
        super().__init__(config)
        self.trainer = trainer
        self.policy = policy
        self.checkpointer = checkpointer
        self.version = 0 if policy is None else policy.version

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        if self.policy is not None:
            self.version = self.policy.version  # a graph can run again: count on from the clock
        async for ready in inbox:
            assert isinstance(ready, BatchReady)
            result = StepResult() if self.trainer is None else await self.trainer.step(ready)
            self.version += 1
            if self.checkpointer is not None:  # before StepDone: a step seen done has its checkpoint
                await self.checkpointer.stepped(self.version, ready.batch_id)
            await outbox.send(step_done(ready.batch_id, self.version, result))
            if self.policy is not None:
                self.policy.publish(self.version)
            await outbox.send(PolicyPublished(policy_version=self.version))
        if self.checkpointer is not None:
            await self.checkpointer.finished(self.version)


def step_done(batch_id: Any, version: int, result: StepResult) -> StepDone:
    """The StepDone event of batch ``batch_id`` stepped to policy ``version`` with ``result``."""
    return StepDone(
        batch_id=batch_id,
        policy_version=version,
        grad_norm=result.grad_norm,
        learn_s=result.learn_s,
        lr=result.lr,
        logprob_mismatch=result.logprob_mismatch,
        audit_rel_error=result.audit_rel_error,
        objective_stats=result.objective_stats,
    )
