"""Bad inputs are refused at the API boundary, naming the argument and the value, before any work runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from thundersync.errors import ConfigError

_MODEL = tiny_qwen3(torch.float32)  # max_position_embeddings=512


@pytest.fixture(params=["grpo", "opd"])
def objective(request: pytest.FixtureRequest) -> Iterator[thundersync.RewardLinearBackward | thundersync.OPDStream]:
    run = thundersync.StreamingRun(_MODEL)
    made = thundersync.RewardLinearBackward(run) if request.param == "grpo" else thundersync.OPDStream(run)
    made.open_group("g", [1, 2, 3])
    yield made
    made.discard()


@pytest.mark.parametrize(
    "scored, shown",
    [(None, "NoneType None"), ("000", "str '000'"), ([0.5, True, True], "0.5"), ([2, 0, 1], "2")],
)
def test_scored_flags_must_be_bools(
    objective: thundersync.RewardLinearBackward | thundersync.OPDStream, scored: object, shown: str
) -> None:
    with pytest.raises(ConfigError, match=rf"scored of trajectory 't' of group 'g' must .*{shown}"):
        objective.append_turn("g", "t", [4, 5, 6], scored)


def test_scored_flags_may_be_a_bool_tensor_or_zeros_and_ones(
    objective: thundersync.RewardLinearBackward | thundersync.OPDStream,
) -> None:
    objective.append_turn("g", "t", [4, 5], torch.tensor([False, False]))
    objective.append_turn("g", "t", [4, 5], [0, 0])


def test_a_bool_tensor_or_bools_are_not_token_ids(
    objective: thundersync.RewardLinearBackward | thundersync.OPDStream,
) -> None:
    with pytest.raises(
        ConfigError, match=r"turn of trajectory 't' of group 'g' must be a 1-D integer tensor, got torch.bool"
    ):
        objective.append_turn("g", "t", torch.tensor([True, False]), [False, False])
    with pytest.raises(ConfigError, match=r"must be a list of int token ids, got the bool True"):
        objective.append_turn("g", "t", [True, 3], [False, False])
    with pytest.raises(ConfigError, match=r"prompt of group 'h' must be a list of int token ids, got str 'abc'"):
        objective.open_group("h", "abc")


def test_unhashable_ids_are_refused(objective: thundersync.RewardLinearBackward | thundersync.OPDStream) -> None:
    with pytest.raises(ConfigError, match=r"group id \['h'\] is a list, which is not hashable"):
        objective.open_group(["h"], [1])
    with pytest.raises(ConfigError, match=r"trajectory id \{'t': 1\} is a dict, which is not hashable"):
        objective.append_turn("g", {"t": 1}, [4], [False])


def test_positions_past_the_model_are_refused_with_the_lengths(
    objective: thundersync.RewardLinearBackward | thundersync.OPDStream,
) -> None:
    objective.append_turn("g", "t", list(range(90)) * 5, [False] * 450)
    with pytest.raises(
        ConfigError, match=r"trajectory 't' of group 'g' would be 513 tokens long .* max_position_embeddings=512"
    ):
        objective.append_turn("g", "t", list(range(60)), [False] * 60)
    objective.append_turn("g", "t", list(range(59)), [False] * 59)  # 3 + 450 + 59 = 512 still fits
    with pytest.raises(ConfigError, match=r"the prompt of group 'long' would be 600 tokens long"):
        objective.open_group("long", [1] * 600)


@pytest.mark.parametrize("reward", [None, "1.0", float("inf")])
def test_grpo_rewards_must_be_finite_numbers(reward: object) -> None:
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(_MODEL))
    grpo.open_group("g", [1, 2])
    grpo.append_turn("g", 0, [3], [True])
    with pytest.raises(ConfigError, match=r"the reward of trajectory 0 of group 'g' (must be a finite number|is inf)"):
        grpo.close_trajectory("g", 0, reward)  # type: ignore[arg-type]  # the wrong type is the point
    grpo.close_trajectory("g", 0, 1.0)  # the failed close left the trajectory open
    grpo.discard()


@pytest.mark.parametrize("name", ["teacher_logprobs", "behaviour_logprobs"])
def test_opd_log_probs_far_outside_any_probability_are_refused(name: str) -> None:
    opd = thundersync.OPDStream(thundersync.StreamingRun(_MODEL))
    opd.open_group("g", [1, 2])
    scores = {"teacher_logprobs": [-1.0, -1.0], name: [-1.0, -1e308]}
    with pytest.raises(ConfigError, match=rf"{name}\[1\] is -1e\+308 .*within \+-10000"):
        opd.append_turn("g", "t", [3, 4], [True, True], **scores)
    opd.discard()
