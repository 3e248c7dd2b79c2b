"""Misuse errors, the step guard, exact zeros, host offload, retained memory and timing independence."""

from __future__ import annotations

import gc

import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from thundersync.errors import ConfigError, StreamingError, UnknownIdError, UnsafeStepError


def _grpo(
    model: torch.nn.Module | None = None, *, pack_tokens: int = 8192, stream_early: bool = True, **run_options: object
) -> thundersync.RewardLinearBackward:
    run = thundersync.StreamingRun(model if model is not None else tiny_qwen3(), **run_options)
    return thundersync.RewardLinearBackward(
        run, eps=1e-6, estimator="grpo", pack_tokens=pack_tokens, stream_early=stream_early
    )


def _grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _batch(grpo: thundersync.RewardLinearBackward, rewards: list[float], *, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for g in range(2):
        grpo.open_group(g, torch.randint(0, 97, (6,), generator=gen))
        for i, reward in enumerate(rewards):
            n = 3 + i
            grpo.append_turn(g, i, torch.randint(0, 97, (n,), generator=gen), [True] * n)
            grpo.append_turn(g, i, [1, 2], [False, False])
            grpo.append_turn(g, i, [3, 4, 5], [True, False, True])
            grpo.close_trajectory(g, i, reward)
        grpo.close_group(g)
    grpo.assert_safe_to_step()


def test_misuse_is_refused_with_clear_messages() -> None:
    grpo = _grpo()
    with pytest.raises(UnknownIdError, match="group 'nope' is not open"):
        grpo.append_turn("nope", 0, [1], [True])
    grpo.open_group("g", [1, 2, 3])
    with pytest.raises(StreamingError, match="group 'g' is already open"):
        grpo.open_group("g", [1])
    with pytest.raises(ConfigError, match="scored has 1 flags but the turn of trajectory 0 of group 'g' has 2 tokens"):
        grpo.append_turn("g", 0, [1, 2], [True])
    with pytest.raises(ConfigError, match="token id 97, outside the vocabulary of size 97"):
        grpo.append_turn("g", 0, [1, 97], [True, True])
    with pytest.raises(ConfigError, match="token id -1, outside the vocabulary"):
        grpo.open_group("h", [-1])
    with pytest.raises(UnknownIdError, match="trajectory 5 of group 'g' has no turn"):
        grpo.close_trajectory("g", 5, 1.0)
    grpo.append_turn("g", 0, [4, 5], [True, True])
    with pytest.raises(ConfigError, match="rewards must be finite"):
        grpo.close_trajectory("g", 0, float("nan"))
    grpo.close_trajectory("g", 0, 1.0)
    with pytest.raises(StreamingError, match="trajectory 0 of group 'g' is closed; it cannot be closed twice"):
        grpo.close_trajectory("g", 0, 1.0)
    with pytest.raises(StreamingError, match="trajectory 0 of group 'g' is closed; cannot append"):
        grpo.append_turn("g", 0, [1], [True])
    grpo.append_turn("g", 1, [6], [True])
    with pytest.raises(StreamingError, match=r"group 'g' has unclosed trajectories \[1\]"):
        grpo.close_group("g")
    with pytest.raises(
        ConfigError, match=r"invalid RewardLinearBackward option: Invalid enum value 'ppo' - at `\$.estimator`"
    ):
        thundersync.RewardLinearBackward(grpo.run, estimator="ppo")  # type: ignore[arg-type]


def test_stepping_with_pending_work_names_it() -> None:
    grpo = _grpo()
    grpo.open_group("g", [1, 2])
    grpo.append_turn("g", "t1", [3], [True])
    with pytest.raises(UnsafeStepError, match=r"open groups: 'g'; unclosed trajectories: 'g'/'t1'; close every"):
        grpo.assert_safe_to_step()
    grpo.close_trajectory("g", "t1", 0.0)
    grpo.close_group("g")
    grpo.assert_safe_to_step()


def test_parameters_modified_in_place_during_the_batch_are_detected() -> None:
    model = tiny_qwen3()
    grpo = _grpo(model)
    grpo.open_group("g", [1, 2])
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    grpo.append_turn("g", 0, [3], [True])
    grpo.close_trajectory("g", 0, 1.0)
    grpo.close_group("g")
    with pytest.raises(UnsafeStepError, match="modified in place since the batch began: lm_head.weight"):
        grpo.assert_safe_to_step()


def test_a_model_with_active_dropout_in_training_mode_is_refused() -> None:
    model = tiny_qwen3()
    model.config.attention_dropout = 0.1
    grpo = _grpo(model.train())
    with pytest.raises(ConfigError, match="training mode with active attention_dropout=0.1.*model.eval"):
        grpo.open_group("g", [1])


def test_a_group_whose_rewards_are_all_equal_contributes_exactly_zero() -> None:
    model = tiny_qwen3()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = _grads(model)
    for pack_tokens in (0, 10_000):
        _batch(_grpo(model, pack_tokens=pack_tokens), [0.5, 0.5, 0.5])
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), before))  # type: ignore[arg-type]


@pytest.mark.parametrize("pack_tokens", [0, 10_000])
def test_host_offloaded_accumulators_give_bitwise_equal_gradients(pack_tokens: int) -> None:
    results = []
    for offload in (None, "cpu"):
        model = tiny_qwen3(seed=3)
        _batch(_grpo(model, pack_tokens=pack_tokens, source_offload_device=offload), [0.0, 1.0, 1.0, 0.3])
        results.append(_grads(model))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("pack_tokens", [0, 7, 10_000])
def test_without_stream_early_background_and_inline_execution_give_bitwise_equal_gradients(pack_tokens: int) -> None:
    """stream_early packs by the worker's state, so only the path without it is bitwise reproducible."""
    results = []
    for background in (False, True):
        model = tiny_qwen3(seed=4)
        _batch(_grpo(model, pack_tokens=pack_tokens, stream_early=False, background=background), [1.0, 0.0, 2.0])
        results.append(_grads(model))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _live_tensor_bytes() -> int:
    """Bytes of every live plain tensor and parameter (exact type checks: issubclass() on some
    objects that torch.compile leaves behind raises)."""
    kinds = (torch.Tensor, torch.nn.Parameter)
    return sum(t.numel() * t.element_size() for t in gc.get_objects() if type(t) in kinds)


def test_retained_memory_does_not_grow_with_closed_trajectories() -> None:
    grpo = _grpo(pack_tokens=0)
    grpo.open_group("g", list(range(10)))
    held, live = [], []
    for i in range(8):
        grpo.append_turn("g", i, list(range(20, 20 + 5 + i)), [True] * (5 + i))
        grpo.close_trajectory("g", i, float(i % 3))
        held.append(grpo.retained_bytes())
        gc.collect()
        live.append(_live_tensor_bytes())
    assert held[1] > 0 and len(set(held[1:])) == 1, held
    assert len(set(live[1:])) == 1, live  # every live tensor in the process, not only ours
    grpo.close_group("g")
    grpo.assert_safe_to_step()
    assert grpo.retained_bytes() == grpo.run.retained_bytes()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_host_offload_on_cuda_gives_bitwise_equal_gradients(dtype: torch.dtype) -> None:
    results = []
    for offload in (None, "cpu"):
        model = tiny_qwen3(seed=5).to("cuda", dtype)
        _batch(_grpo(model, pack_tokens=0, source_offload_device=offload), [0.0, 1.0, 0.25])
        results.append(_grads(model))
    assert all(torch.equal(a, b) for a, b in zip(*results))
