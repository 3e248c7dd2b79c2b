"""Streamed GRPO gradients equal the dense reference for random groups, masks, rewards and orders."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thundersync
from tests.engine.tiny_models import tiny_qwen3, with_lora
from tests.grpo.grpo_cases import Group, dense_objective, grads, groups, interleaving, relative_error

EPS = 1e-6


def stream(
    model: torch.nn.Module, plan: list[Group], estimator: str, order_seed: int, *, pack_tokens: int, background: bool
) -> None:
    run = thundersync.StreamingRun(model, background=background)
    grpo = thundersync.RewardLinearBackward(run, eps=EPS, estimator=estimator, pack_tokens=pack_tokens)
    for op in interleaving(plan, random.Random(order_seed)):
        if op[0] == "open":
            grpo.open_group(f"g{op[1]}", plan[op[1]].prompt)
        elif op[0] == "append":
            turn = plan[op[1]].trajectories[op[2]].turns[op[3]]
            grpo.append_turn(f"g{op[1]}", op[2], turn.tokens, turn.scored)
        elif op[0] == "close":
            grpo.close_trajectory(f"g{op[1]}", op[2], plan[op[1]].trajectories[op[2]].reward)
        else:
            grpo.close_group(f"g{op[1]}")
    grpo.assert_safe_to_step()


def prefill(model: torch.nn.Module, seed: int) -> None:
    """Existing .grad content that the streamed gradient must be added to."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(groups(), min_size=1, max_size=3),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
    order_seed=st.integers(0, 2**16),
    pack_tokens=st.sampled_from([0, 12, 30, 10_000]),
    background=st.booleans(),
)
def test_streamed_gradient_equals_the_dense_reference(
    dtype: torch.dtype,
    tolerance: float,
    lora: bool,
    plan: list[Group],
    estimator: str,
    order_seed: int,
    pack_tokens: int,
    background: bool,
) -> None:
    base = tiny_qwen3(dtype)
    model = with_lora(base) if lora else base
    reference = copy.deepcopy(model)
    prefill(model, order_seed)
    prefill(reference, order_seed)
    dense_objective(reference, plan, estimator, EPS).backward()
    stream(model, plan, estimator, order_seed, pack_tokens=pack_tokens, background=background)
    assert relative_error(grads(model), grads(reference)) < tolerance
