"""Both objectives implement the StreamingObjective contract; each is configured by its own Config."""

from __future__ import annotations

import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from thundersync.engine.objective import StreamingObjective
from thundersync.errors import ConfigError


def _objectives() -> tuple[thundersync.RewardLinearBackward, thundersync.OPDStream]:
    model = tiny_qwen3(torch.float64)
    return (
        thundersync.RewardLinearBackward(thundersync.StreamingRun(model)),
        thundersync.OPDStream(thundersync.StreamingRun(model)),
    )


def test_grpo_and_opd_are_streaming_objectives_with_their_signals() -> None:
    grpo, opd = _objectives()
    objectives: list[StreamingObjective] = [grpo, opd]  # mypy --strict checks the classes: _conforms in each stream.py
    assert all(isinstance(o, StreamingObjective) for o in objectives)
    assert (grpo.signal, opd.signal) == ("reward", "teacher")


def test_grpo_refuses_teacher_log_probs_and_needs_a_reward() -> None:
    grpo, _ = _objectives()
    grpo.open_group("g", [1, 2])
    with pytest.raises(ConfigError, match=r"GRPO\) learns from rewards, not teacher log-probs.*use an OPDStream"):
        grpo.append_turn("g", "t", [3], [True], teacher_logprobs=[-1.0])
    grpo.append_turn("g", "t", [3], [True])
    with pytest.raises(
        ConfigError, match=r"the reward of trajectory 't' of group 'g' must be a finite number, got None"
    ):
        grpo.close_trajectory("g", "t")
    grpo.discard()


def test_opd_refuses_a_reward() -> None:
    _, opd = _objectives()
    opd.open_group("g", [1, 2])
    opd.append_turn("g", "t", [3], [True], teacher_logprobs=[-1.0])
    with pytest.raises(ConfigError, match=r"OPDStream learns from teacher log-probs, not rewards.*got 1.0"):
        opd.close_trajectory("g", "t", reward=1.0)
    opd.discard()


def test_options_are_keywords_or_a_config_and_are_validated() -> None:
    model = tiny_qwen3()
    run = thundersync.StreamingRun(model, source_offload_device=torch.device("cpu"), background=False)
    assert run.config == thundersync.StreamingRun.Config(source_offload_device="cpu", background=False)
    grpo = thundersync.RewardLinearBackward(run, eps=0.5, estimator="rloo", pack_tokens=0)
    config = thundersync.RewardLinearBackward.Config(eps=0.5, estimator="rloo", pack_tokens=0)
    assert grpo.config == config == thundersync.RewardLinearBackward(run, config).config
    assert thundersync.OPDStream(run, normalization="sum").config.normalization == "sum"
    with pytest.raises(ConfigError, match=r"invalid StreamingRun option: Object contains unknown field `pack_tokens`"):
        thundersync.StreamingRun(model, pack_tokens=8)
    with pytest.raises(ConfigError, match=r"invalid RewardLinearBackward option: Expected `int` >= 0.*pack_tokens"):
        thundersync.RewardLinearBackward(run, pack_tokens=-1)
    with pytest.raises(ConfigError, match=r"invalid RewardLinearBackward option: Expected `float` >= 0.0.*eps"):
        thundersync.RewardLinearBackward(run, eps=float("nan"))
    with pytest.raises(ConfigError, match=r"invalid OPDStream option: Invalid enum value 'mean'.*normalization"):
        thundersync.OPDStream(run, normalization="mean")
    with pytest.raises(ConfigError, match=r"OPDStream takes a OPDStream.Config or keyword options, not both"):
        thundersync.OPDStream(run, thundersync.OPDStream.Config(), pack_tokens=3)
    with pytest.raises(ConfigError, match=r"invalid StreamingRun option: Expected `bool \| null`, got `str`"):
        thundersync.StreamingRun(model, background="no")  # strict: a str is not a bool
    with pytest.raises(ConfigError, match=r"source_offload_device 'gpu0' is not a torch device"):
        thundersync.StreamingRun(model, source_offload_device="gpu0")
