"""The step stage steps once per ready batch, then publishes the new policy version."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from thundersync.events import BatchReady, PolicyPublished, StepDone
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.step import StepResult, StepStage, StreamingTrainer
from thundersync.testing import RecordingTrainer

pytestmark = pytest.mark.anyio


async def test_each_ready_batch_is_stepped_then_published(run_stage: Callable[..., Any]) -> None:
    clock, trainer = PolicyClock(version=3), RecordingTrainer()
    batches = [BatchReady(batch_id="a", num_scored_tokens=5), BatchReady(batch_id="b", num_scored_tokens=7)]
    out = await run_stage(StepStage(trainer=trainer, policy=clock), batches)
    assert out == [
        StepDone(batch_id="a", policy_version=4, grad_norm=5.0),
        PolicyPublished(policy_version=4),
        StepDone(batch_id="b", policy_version=5, grad_norm=7.0),
        PolicyPublished(policy_version=5),
    ]
    assert trainer.steps == batches and clock.version == 5


async def test_without_a_trainer_the_stage_only_counts(run_stage: Callable[..., Any]) -> None:
    out = await run_stage(StepStage(), [BatchReady(batch_id=0)])
    assert out == [StepDone(batch_id=0, policy_version=1), PolicyPublished(policy_version=1)]


class _RecordingCheckpointer:
    """Records each call with the policy version live at that moment."""

    def __init__(self, clock: PolicyClock) -> None:
        self.clock = clock
        self.calls: list[tuple[str, int, object, int]] = []

    async def stepped(self, step: int, batch_id: object) -> None:
        self.calls.append(("stepped", step, batch_id, self.clock.version))

    async def finished(self, step: int) -> None:
        self.calls.append(("finished", step, None, self.clock.version))


async def test_the_checkpointer_sees_each_step_before_its_policy_is_published(run_stage: Callable[..., Any]) -> None:
    clock = PolicyClock(version=2)
    checkpointer = _RecordingCheckpointer(clock)
    stage = StepStage(trainer=RecordingTrainer(), policy=clock, checkpointer=checkpointer)
    await run_stage(stage, [BatchReady(batch_id="a"), BatchReady(batch_id="b")])
    assert checkpointer.calls == [("stepped", 3, "a", 2), ("stepped", 4, "b", 3), ("finished", 4, None, 4)]


class _FixedTrainer:
    async def step(self, ready: BatchReady) -> StepResult:
        return StepResult(grad_norm=1.5, learn_s=0.25, lr=3e-4, logprob_mismatch=0.125)


async def test_step_done_carries_what_the_trainer_reports(run_stage: Callable[..., Any]) -> None:
    (done, _) = await run_stage(StepStage(trainer=_FixedTrainer()), [BatchReady(batch_id=0)])
    assert done == StepDone(batch_id=0, policy_version=1, grad_norm=1.5, learn_s=0.25, lr=3e-4, logprob_mismatch=0.125)


class _Run:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.data_parallel = None  # a single-process run


class _MismatchObjective:
    """A streaming objective whose batch is done: its one parameter holds the gradient [3, 4]."""

    def __init__(self, mismatch: float | None) -> None:
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.weight.grad = torch.tensor([3.0, 4.0])
        self.run = _Run([self.weight])
        self.signal = None
        self.mismatch = mismatch

    def open_group(self, group_id: object, prompt_tokens: object) -> None: ...
    def append_turn(self, *args: object, **kwargs: object) -> None: ...
    def close_trajectory(self, group_id: object, trajectory_id: object, reward: float | None = None) -> None: ...
    def close_group(self, group_id: object) -> None: ...
    def assert_safe_to_step(self) -> None: ...
    def discard(self) -> None: ...

    def take_logprob_mismatch(self) -> float | None:
        taken, self.mismatch = self.mismatch, None
        return taken


async def test_the_streaming_trainer_reports_lr_time_and_the_objectives_logprob_mismatch() -> None:
    objective = _MismatchObjective(0.03125)
    optimizer = torch.optim.SGD([objective.weight], lr=0.5)
    result = await StreamingTrainer(objective, optimizer).step(BatchReady(batch_id=0))  # type: ignore[arg-type]  # a fake, not a StreamingRun
    assert (result.grad_norm, result.lr, result.logprob_mismatch) == (5.0, 0.5, 0.03125)
    assert result.learn_s > 0 and objective.weight.tolist() == [-1.5, -2.0]
    assert (await StreamingTrainer(objective, optimizer).step(BatchReady(batch_id=1))).logprob_mismatch is None


class _PlainOptimizer:
    """An optimizer without param_groups (a duck-typed one)."""

    def step(self) -> None: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...


async def test_an_optimizer_without_param_groups_reports_no_lr() -> None:
    trainer = StreamingTrainer(_MismatchObjective(None), _PlainOptimizer())  # type: ignore[arg-type]  # fakes
    assert (await trainer.step(BatchReady(batch_id=0))).lr is None


class _LockChecking:
    """An optimizer that records whether the model's adapter lock was held while it stepped."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.held: list[bool] = []

    def step(self) -> None:
        from thundersync.model.anatomy import adapter_lock

        self.held.append(adapter_lock(self.model).locked())

    def zero_grad(self, set_to_none: bool = True) -> None: ...


async def test_the_optimizer_steps_under_the_models_adapter_lock() -> None:
    """A torch-generator over the same model steps its batcher under that lock: with max_staleness >= 1
    a decode step then never reads weights the optimizer is writing."""
    import thundersync
    from tests.engine.tiny_models import tiny_qwen3

    model = tiny_qwen3(torch.float64)
    objective = thundersync.RewardLinearBackward(thundersync.StreamingRun(model))
    optimizer = _LockChecking(model)
    await StreamingTrainer(objective, optimizer).step(BatchReady(batch_id=0))  # type: ignore[arg-type]  # a duck-typed optimizer
    assert optimizer.held == [True]


class _Recording:
    """An optimizer that records its step, and whether the model's adapter lock was held, in ``calls``."""

    def __init__(self, model: torch.nn.Module, calls: list[tuple[str, bool]]) -> None:
        self.model, self.calls = model, calls

    def step(self) -> None:
        from thundersync.model.anatomy import adapter_lock

        self.calls.append(("step", adapter_lock(self.model).locked()))

    def zero_grad(self, set_to_none: bool = True) -> None: ...


@pytest.mark.parametrize("max_staleness", [0, 1])
async def test_the_step_waits_for_the_device_only_when_a_generator_decodes_across_it(
    max_staleness: int, run_stage: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With max_staleness >= 1 generate lets its torch-generator decode across the optimizer step
    (allow_weight_changes), and the step waits for the device inside the adapter lock, before and
    after; at 0 no decode step runs meanwhile and the step waits for nothing."""
    import thundersync
    from tests.engine.tiny_models import tiny_qwen3
    from thundersync.generation import TorchGenerator
    from thundersync.model.anatomy import adapter_lock, decoded_across_steps
    from thundersync.stages import step
    from thundersync.stages.generate import GenerateStage

    model = tiny_qwen3(torch.float64)
    generate = GenerateStage(
        generator=TorchGenerator(model, max_batch=2, max_seq_len=32), policy=PolicyClock(max_staleness=max_staleness)
    )
    await run_stage(generate, [])
    assert decoded_across_steps(model) == (max_staleness > 0)
    objective = thundersync.RewardLinearBackward(thundersync.StreamingRun(model))
    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        step, "_synchronize", lambda params: calls.append(("synchronize", adapter_lock(model).locked()))
    )
    await StreamingTrainer(objective, _Recording(model, calls)).step(BatchReady(batch_id=0))  # type: ignore[arg-type]  # a duck-typed optimizer
    waits = [("synchronize", True)] if max_staleness else []
    assert calls == [*waits, ("step", True), *waits]


def test_the_steps_wait_is_a_cuda_synchronize_of_the_parameters_device_and_nothing_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from thundersync.stages import step

    synchronized: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronized.append)
    step._synchronize([torch.zeros(1)])
    step._synchronize([])
    assert synchronized == []
    step._synchronize([SimpleNamespace(device=torch.device("cuda", 1))])  # type: ignore[list-item]  # a CUDA parameter, faked
    assert synchronized == [torch.device("cuda", 1)]
