"""The estimators' advantages and accumulator coefficients against their definitions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync.grpo.estimators import accumulator_coefficients, advantages, contributes

rewards_st = st.lists(st.sampled_from([0.0, 1.0, -0.5]) | st.floats(-10, 10, allow_nan=False), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(rewards=rewards_st, reference=st.floats(-5, 5))
def test_accumulator_coefficients_reproduce_the_advantage_weighted_sum(rewards: list[float], reference: float) -> None:
    for estimator in ("grpo", "dr_grpo", "rloo"):
        a = advantages(rewards, estimator, 1e-6)
        if not contributes(rewards, estimator):
            assert a == [0.0] * len(rewards)
            continue
        c1, c2 = accumulator_coefficients(rewards, estimator, 1e-6, reference)
        # with scalar "gradients" g_i = 1 and g_i = r_i^2 the two sides must agree
        for g in ([1.0] * len(rewards), [r * r for r in rewards]):
            lhs = sum(ai * gi for ai, gi in zip(a, g))
            g1 = sum((r - reference) * gi for r, gi in zip(rewards, g))
            assert lhs == pytest.approx(
                c1 * g1 + c2 * sum(g), rel=1e-9, abs=1e-9 * (1 + sum(map(abs, g))) * (1 + abs(c1) + abs(c2))
            )


def test_rloo_is_the_leave_one_out_baseline_and_zero_for_a_group_of_one() -> None:
    rewards = [1.0, 0.0, 0.0, 3.0]
    expected = [r - (sum(rewards) - r) / 3 for r in rewards]
    assert advantages(rewards, "rloo", 1e-6) == pytest.approx(expected)
    assert advantages([2.0], "rloo", 1e-6) == [0.0]


def test_grpo_uses_the_population_std_and_eps() -> None:
    rewards = [0.0, 1.0]
    assert advantages(rewards, "grpo", 0.5) == pytest.approx([-0.5, 0.5])  # std 0.5, (r - 0.5) / 1.0
    assert advantages(rewards, "dr_grpo", 0.5) == pytest.approx([-0.5, 0.5])
    assert math.isclose(advantages([0.0, 2.0], "grpo", 0.0)[1], 1.0)
