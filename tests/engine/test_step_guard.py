"""The safe-to-step guard: shared parameters, replaced parameters and non-finite totals never reach .grad."""

from __future__ import annotations

import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from thundersync.errors import ConfigError, UnsafeStepError


def _fill_grads(model: torch.nn.Module, value: float) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


def _grads_are(model: torch.nn.Module, value: float) -> bool:
    return all(p.grad is not None and bool((p.grad == value).all()) for p in model.parameters())


def test_two_objectives_on_one_model_cannot_have_batches_at_once_even_through_separate_runs() -> None:
    """OPD writes into p.grad during its batch: a GRPO step meanwhile would carry OPD's partial
    sums, and OPD's division by N and its discard() would reach GRPO's part."""
    model = tiny_qwen3(torch.float64)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model))
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model))
    opd.open_group("o", [1, 2])
    opd.append_turn("o", 0, [3, 4], [True, True], teacher_logprobs=[-1.0, -2.0])
    with pytest.raises(
        ConfigError,
        match=r"parameter model.embed_tokens.weight is in a logical batch of a OPDStream on another StreamingRun.*"
        r"finish that batch \(assert_safe_to_step\(\) or discard\(\)\) before this RewardLinearBackward opens a group",
    ):
        grpo.open_group("g", [1, 2])
    opd.close_trajectory("o", 0)
    opd.close_group("o")
    opd.assert_safe_to_step()
    grpo.open_group("g", [1, 2])  # the parameters are free again
    grpo.discard()


def test_the_second_objective_message_no_longer_recommends_a_second_run_on_the_same_model() -> None:
    run = thundersync.StreamingRun(tiny_qwen3(torch.float32))
    grpo, opd = thundersync.RewardLinearBackward(run), thundersync.OPDStream(run)
    grpo.open_group("g", [1, 2, 3])
    with pytest.raises(ConfigError, match=r"cannot stream into the same parameters at the same time") as refused:
        opd.open_group("h", [1, 2])
    assert "own StreamingRun" not in str(refused.value)
    grpo.discard()


def test_a_discarded_or_collected_batch_frees_the_parameters() -> None:
    model = tiny_qwen3(torch.float32)
    first = thundersync.RewardLinearBackward(thundersync.StreamingRun(model))
    first.open_group("g", [1])
    first.discard()
    second = thundersync.OPDStream(thundersync.StreamingRun(model))
    second.open_group("g", [1])
    del second  # never finished, but gone with its run: its claims go too
    import gc

    gc.collect()
    thundersync.RewardLinearBackward(thundersync.StreamingRun(model)).open_group("g", [1])


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_a_parameter_replaced_mid_batch_drops_the_batch_instead_of_losing_its_gradient(objective: str) -> None:
    model = tiny_qwen3(torch.float64)
    _fill_grads(model, 0.5)
    run = thundersync.StreamingRun(model)
    made = thundersync.RewardLinearBackward(run) if objective == "grpo" else thundersync.OPDStream(run)
    made.open_group("g", [1, 2])
    teacher = {"teacher_logprobs": [-1.0, -2.0]} if objective == "opd" else {}
    for t, reward in ((0, 1.0), (1, 0.0)):
        made.append_turn("g", t, [3, 4], [True, True], **teacher)
        made.close_trajectory("g", t, reward if objective == "grpo" else None)
    mlp = model.model.layers[0].mlp.up_proj
    mlp.weight = torch.nn.Parameter(mlp.weight.detach().clone())  # the user's mistake
    mlp.weight.grad = torch.full_like(mlp.weight, 0.5)
    made.close_group("g")
    with pytest.raises(
        UnsafeStepError,
        match=r"replaced by new Parameter objects since the batch began: model.layers.0.mlp.up_proj.weight.*dropped",
    ):
        made.assert_safe_to_step()
    assert _grads_are(model, 0.5)
    with pytest.raises(ConfigError, match=r"replaced since the StreamingRun was made.*make a new StreamingRun"):
        made.open_group("g2", [1])


def test_grpo_rewards_too_large_for_the_accumulators_are_refused_at_the_step() -> None:
    model = tiny_qwen3(torch.float32)
    _fill_grads(model, 0.25)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), pack_tokens=0)
    grpo.open_group("g", [1, 2])
    for t, reward in enumerate([0.0, 3e38, 1.0]):
        grpo.append_turn("g", t, [3, 4, 5], [True, True, True])
        grpo.close_trajectory("g", t, reward)
    grpo.close_group("g")
    with pytest.raises(UnsafeStepError, match=r"gradient is not finite \(inf or nan in .*\).*huge rewards.*dropped"):
        grpo.assert_safe_to_step()
    assert _grads_are(model, 0.25)


def test_a_non_finite_opd_gradient_is_refused_and_grad_restored() -> None:
    model = tiny_qwen3(torch.float32)
    with torch.no_grad():
        model.lm_head.weight[7, 0] = 3e38  # finite, but the logits overflow
    _fill_grads(model, 0.25)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model))
    opd.open_group("g", [1, 2])
    opd.append_turn("g", 0, [3, 4], [True, True], teacher_logprobs=[-1.0, -2.0])
    opd.close_trajectory("g", 0)
    opd.close_group("g")
    with pytest.raises(UnsafeStepError, match=r"gradient is not finite .*; the batch was dropped"):
        opd.assert_safe_to_step()
    assert _grads_are(model, 0.25)


def test_the_first_non_finite_gradient_is_named() -> None:
    model = tiny_qwen3(torch.float32)
    guard = thundersync.StreamingRun(model).guard
    (a, p1), (_, p2), (c, p3) = list(model.named_parameters())[:3]
    grads = [(p1, torch.zeros(2)), (p2, None), (p3, torch.tensor([1.0, float("nan")]))]
    assert guard.non_finite(grads[:2]) is None and guard.non_finite([]) is None
    assert f"inf or nan in {c})" in str(guard.non_finite(grads))
    grads[0] = (p1, torch.tensor([float("-inf")]))
    assert f"inf or nan in {a})" in str(guard.non_finite(grads))
