"""Dropping a failed group keeps the streamed update exact for what is kept: the gradient equals the
dense GRPO reference over the kept groups (fp64), whatever had already streamed of the dropped one."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from tests.grpo.grpo_cases import Group, dense_objective, grads, groups, interleaving, relative_error
from tests.grpo.test_stream import EPS, call, prefill
from thundersync.errors import StreamingError


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(groups(), min_size=2, max_size=4),
    dropped=st.sets(st.integers(0, 3), min_size=1, max_size=2),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
    order_seed=st.integers(0, 2**16),
    pack_tokens=st.sampled_from([0, 12, 10_000]),
    background=st.booleans(),
    stream_early=st.booleans(),
)
def test_dropping_groups_equals_the_dense_update_over_the_kept_groups_in_fp64(
    plan: list[Group],
    dropped: set[int],
    estimator: str,
    order_seed: int,
    pack_tokens: int,
    background: bool,
    stream_early: bool,
) -> None:
    dropped = {g for g in dropped if g < len(plan)} or {0}
    kept = [group for g, group in enumerate(plan) if g not in dropped]
    model = tiny_qwen3(torch.float64)
    reference = copy.deepcopy(model)
    prefill(model, order_seed)
    prefill(reference, order_seed)
    if kept:
        dense_objective(reference, kept, estimator, EPS).backward()
    run = thundersync.StreamingRun(model, background=background)
    grpo = thundersync.RewardLinearBackward(
        run, eps=EPS, estimator=estimator, pack_tokens=pack_tokens, stream_early=stream_early
    )
    for op in interleaving(plan, random.Random(order_seed)):
        if op[0] == "close_group" and op[1] in dropped:
            grpo.drop_group(f"g{op[1]}")  # after its branches closed: some may have streamed already
        else:
            call(grpo, plan, op)
    grpo.assert_safe_to_step()
    assert relative_error(grads(model), grads(reference)) < 1e-10


def test_a_group_with_an_open_trajectory_cannot_be_dropped() -> None:
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(tiny_qwen3(torch.float64)))
    grpo.open_group("g", [1, 2, 3])
    grpo.append_turn("g", 0, [4, 5], [True, True])
    with pytest.raises(StreamingError, match=r"group 'g' has unclosed trajectories \[0\]; close them first"):
        grpo.drop_group("g")
    grpo.close_trajectory("g", 0, 1.0)
    grpo.drop_group("g")
    grpo.assert_safe_to_step()
