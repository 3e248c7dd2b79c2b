"""The trainer's exactness audit: every N-th step, the streamed gradient against a dense recomputation."""

from __future__ import annotations

import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from thundersync.app.factories import training
from thundersync.engine.sinks import FlatAccumulator
from thundersync.errors import ConfigError
from thundersync.events import BatchReady
from thundersync.stages.step import StreamingTrainer

pytestmark = pytest.mark.anyio


def _grpo_batch(grpo: thundersync.RewardLinearBackward, seed: int) -> None:
    """Two groups of three multi-turn trajectories (an observation turn in each), distinct rewards."""
    gen = torch.Generator().manual_seed(seed)
    for g in range(2):
        grpo.open_group(g, torch.randint(0, 97, (5,), generator=gen))
        for i in range(3):
            grpo.append_turn(g, i, torch.randint(0, 97, (4 + i,), generator=gen), [True, False] + [True] * (2 + i))
            grpo.append_turn(g, i, [7, 8], [False, False])
            grpo.append_turn(g, i, torch.randint(0, 97, (3,), generator=gen), [True] * 3)
            grpo.close_trajectory(g, i, [0.0, 1.0, 0.25][i] + seed)
        grpo.close_group(g)


def _opd_batch(opd: thundersync.OPDStream, seed: int) -> None:
    """One group of two trajectories: action, observation, action (the second with behaviour log-probs)."""
    gen = torch.Generator().manual_seed(seed)
    opd.open_group("g", torch.randint(0, 97, (4,), generator=gen))
    for t in range(2):
        opd.append_turn(
            "g", t, torch.randint(0, 97, (3,), generator=gen), [True] * 3, teacher_logprobs=[-1.0, -2.0, -0.5]
        )
        opd.append_turn("g", t, [5, 6], [False, False])
        opd.append_turn("g", t, [9, 10], [True, True], teacher_logprobs=[-0.25, -3.0], behaviour_logprobs=[-0.5, -2.5])
        opd.close_trajectory("g", t)
    opd.close_group("g")


async def test_grpo_audit_runs_every_nth_step_and_is_below_1e_10_in_fp64() -> None:
    model = tiny_qwen3(torch.float64)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), pack_tokens=12)
    trainer = training.trainer(objective=grpo, optimizer=torch.optim.SGD(grpo.run.params, lr=1e-2), audit_every=2)
    errors = []
    for step in range(4):
        _grpo_batch(grpo, step)
        errors.append((await trainer.step(BatchReady(batch_id=step))).audit_rel_error)
    assert errors[0] is None and errors[2] is None
    assert errors[1] is not None and errors[3] is not None
    assert 0 < errors[1] < 1e-10 and 0 < errors[3] < 1e-10, errors


async def test_opd_audit_is_below_1e_10_in_fp64() -> None:
    model = tiny_qwen3(torch.float64)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model))
    trainer = StreamingTrainer(opd, torch.optim.SGD(opd.run.params, lr=1e-2), audit_every=1)
    for step in range(2):
        _opd_batch(opd, step)
        error = (await trainer.step(BatchReady(batch_id=step))).audit_rel_error
        assert error is not None and 0 < error < 1e-10, error


async def test_a_corrupted_stream_gives_a_large_audit_error(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = FlatAccumulator.add_scratch

    def scaled(self: FlatAccumulator, capture: object, scale: float = 1.0) -> None:
        plain(self, capture, scale * 1.5)  # type: ignore[arg-type]  # the capture is passed through

    monkeypatch.setattr(FlatAccumulator, "add_scratch", scaled)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(tiny_qwen3(torch.float64)))
    trainer = StreamingTrainer(grpo, torch.optim.SGD(grpo.run.params, lr=1e-2, maximize=True), audit_every=1)
    _grpo_batch(grpo, 0)
    error = (await trainer.step(BatchReady(batch_id=0))).audit_rel_error
    assert error is not None and abs(error - 0.5) < 1e-9  # every branch ran in the close pack: 1.5 g


def test_audit_settings_and_misuse_are_refused_with_clear_messages() -> None:
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(tiny_qwen3()))
    optimizer = torch.optim.SGD(grpo.run.params, lr=1e-2)
    with pytest.raises(ConfigError, match="audit_every is -1; give a step count >= 1, or 0 for no audit"):
        StreamingTrainer(grpo, optimizer, audit_every=-1)
    with pytest.raises(ConfigError, match="no batch was kept for a dense gradient: call keep_batch"):
        grpo.dense_gradient()


def test_an_objective_that_cannot_audit_is_refused() -> None:
    class _NoAudit:
        signal = "reward"

        def __init__(self, run: thundersync.StreamingRun) -> None:
            self.run = run

        def open_group(self, group_id: object, prompt_tokens: object) -> None: ...
        def append_turn(self, *args: object, **kwargs: object) -> None: ...
        def close_trajectory(self, group_id: object, trajectory_id: object, reward: float | None = None) -> None: ...
        def close_group(self, group_id: object) -> None: ...
        def assert_safe_to_step(self) -> None: ...
        def discard(self) -> None: ...

    objective = _NoAudit(thundersync.StreamingRun(tiny_qwen3()))
    optimizer = torch.optim.SGD(objective.run.params, lr=1e-2)
    with pytest.raises(ConfigError, match="audit_every=3 needs an objective that can recompute .* _NoAudit cannot"):
        StreamingTrainer(objective, optimizer, audit_every=3)  # type: ignore[arg-type]  # a fake objective
