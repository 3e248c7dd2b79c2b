"""When a GRPO trajectory's backward starts: ``pack_tokens`` chosen by placement, and the batch's
tail flushed once every group has opened (``all_groups_opened``), equal to the dense reference."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from tests.grpo.grpo_cases import Group, dense_objective, grads, groups, interleaving, relative_error
from tests.grpo.test_stream import EPS, call, prefill
from thundersync.app.factories import training
from thundersync.errors import ConfigError
from thundersync.grpo.stream import PACK_TOKENS_SHARED, default_pack_tokens


def test_pack_tokens_follows_the_placement_and_a_given_value_wins() -> None:
    run = thundersync.StreamingRun(tiny_qwen3())
    assert default_pack_tokens(run) == PACK_TOKENS_SHARED == 8192
    assert default_pack_tokens(run, own_device=True) == 0
    assert thundersync.RewardLinearBackward(run).pack_tokens == 8192  # co-located: today's packing
    run.streams.sms = 64  # as Acceleration(learner_sms=64) leaves it on a GPU (tests/engine/test_green.py)
    grpo = thundersync.RewardLinearBackward(run)
    assert grpo.pack_tokens == grpo.config.pack_tokens == 0  # each trajectory as it closes
    assert thundersync.RewardLinearBackward(run, pack_tokens=4096).pack_tokens == 4096


def test_pack_tokens_lives_once_in_the_objectives_config() -> None:
    """The resolved value is the config's (what a learner process's child rebuilds the objective
    from); the attribute reads it and cannot be set apart from it."""
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(tiny_qwen3()))
    assert grpo.config.pack_tokens == grpo.pack_tokens == 8192
    with pytest.raises(AttributeError):
        grpo.pack_tokens = 0  # type: ignore[misc]
    assert thundersync.RewardLinearBackward(grpo.run, grpo.config).pack_tokens == 8192


def test_the_grpo_factory_leaves_pack_tokens_to_the_placement_unless_the_file_gives_it() -> None:
    run = thundersync.StreamingRun(tiny_qwen3())
    objective = training.grpo(run=run)
    assert isinstance(objective, thundersync.RewardLinearBackward) and objective.pack_tokens == 8192
    run.streams.sms = 64
    objective = training.grpo(run=run)
    assert isinstance(objective, thundersync.RewardLinearBackward) and objective.pack_tokens == 0
    objective = training.grpo(run=run, pack_tokens=8192)
    assert isinstance(objective, thundersync.RewardLinearBackward) and objective.pack_tokens == 8192
    assert training._device_of("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="process_device 'gpu1' is not a torch device"):
        training._device_of("gpu1")


def _submitted(run: thundersync.StreamingRun) -> list[str]:
    labels: list[str] = []
    submit = run.submit

    def record(label: str, job: object) -> None:
        labels.append(label)
        submit(label, job)  # type: ignore[arg-type]

    run.submit = record  # type: ignore[method-assign]
    return labels


@pytest.mark.parametrize("tail_groups", [2, 0])
def test_once_every_group_has_opened_waiting_branches_go_and_later_ones_go_at_their_close(tail_groups: int) -> None:
    flush = tail_groups > 0
    run = thundersync.StreamingRun(tiny_qwen3())
    labels = _submitted(run)
    grpo = thundersync.RewardLinearBackward(run, tail_groups=tail_groups)  # pack_tokens 8192 here
    for g in ("a", "b"):
        grpo.open_group(g, [1, 2, 3])
        for i in range(2):
            grpo.append_turn(g, i, [4 + i, 5], [True, True])
    grpo.close_trajectory("a", 0, 1.0)
    assert labels == []  # waits for 8192 tokens or its group's close
    grpo.all_groups_opened()
    if flush:
        assert labels == ["prompt forward of group 'a'", "backward of 1 branches of group 'a' (reward 1.0)"]
    grpo.close_trajectory("b", 1, 0.0)  # after the flush: at its close
    if flush:
        assert labels[-2:] == ["prompt forward of group 'b'", "backward of 1 branches of group 'b' (reward 0.0)"]
    else:
        assert labels == []
    for g, i in (("a", 1), ("b", 0)):
        grpo.close_trajectory(g, i, 0.5)
    grpo.close_group("a")
    grpo.close_group("b")
    grpo.assert_safe_to_step()
    labels.clear()
    grpo.open_group("c", [1, 2])  # a new batch: waits again until its groups have all opened
    grpo.append_turn("c", 0, [3], [True])
    grpo.close_trajectory("c", 0, 1.0)
    assert labels == []
    grpo.discard()


def test_only_the_last_tail_groups_open_groups_stream_at_each_close() -> None:
    """tail_groups = 1 with two groups open: nothing goes at the signal; when one group closes,
    the other, now the batch's last, submits what waits and each later branch at its close."""
    run = thundersync.StreamingRun(tiny_qwen3())
    labels = _submitted(run)
    grpo = thundersync.RewardLinearBackward(run, tail_groups=1)
    for g in ("a", "b"):
        grpo.open_group(g, [1, 2, 3])
        for i in range(2):
            grpo.append_turn(g, i, [4 + i, 5], [True, True])
    grpo.all_groups_opened()
    grpo.close_trajectory("b", 0, 1.0)
    grpo.close_trajectory("a", 0, 1.0)
    grpo.close_trajectory("a", 1, 0.0)
    assert labels == []  # two groups open: no tail yet
    grpo.close_group("a")
    assert labels[-3:] == [
        "close of group 'a' with 2 branches",
        "prompt forward of group 'b'",
        "backward of 1 branches of group 'b' (reward 1.0)",
    ]
    grpo.close_trajectory("b", 1, 0.0)
    assert labels[-1] == "backward of 1 branches of group 'b' (reward 0.0)"
    grpo.close_group("b")
    grpo.assert_safe_to_step()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(groups(), min_size=1, max_size=3),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
    order_seed=st.integers(0, 2**16),
    pack_tokens=st.sampled_from([12, 30, 10_000]),
    background=st.booleans(),
    at=st.integers(0, 60),
    tail_groups=st.sampled_from([1, 2, 10]),
)
def test_a_flushed_tail_equals_the_dense_reference(
    dtype: torch.dtype,
    tolerance: float,
    plan: list[Group],
    estimator: str,
    order_seed: int,
    pack_tokens: int,
    background: bool,
    at: int,
    tail_groups: int,
) -> None:
    """``all_groups_opened`` after the last group opened, ``at`` calls later (or at the end: then
    it finds everything closed), in a random interleaving: the gradient is the dense one."""
    model = tiny_qwen3(dtype)
    reference = copy.deepcopy(model)
    prefill(model, order_seed)
    prefill(reference, order_seed)
    dense_objective(reference, plan, estimator, EPS).backward()
    run = thundersync.StreamingRun(model, background=background)
    grpo = thundersync.RewardLinearBackward(
        run, eps=EPS, estimator=estimator, pack_tokens=pack_tokens, tail_groups=tail_groups
    )
    ops = list(interleaving(plan, random.Random(order_seed)))
    last_open = max(i for i, op in enumerate(ops) if op[0] == "open")
    flush_at = min(last_open + 1 + at, len(ops))
    for index, op in enumerate(ops):
        if index == flush_at:
            grpo.all_groups_opened()
        call(grpo, plan, op)
    if flush_at == len(ops):
        grpo.all_groups_opened()
    grpo.assert_safe_to_step()
    assert relative_error(grads(model), grads(reference)) < tolerance


def test_a_learner_process_on_another_device_gets_per_trajectory_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's run cannot know that its GPU is its own: the factory decides, unless the file gives pack_tokens."""
    built: list[dict[str, object]] = []

    class FakeLearnerProcess:
        def __init__(self, run: object, build: Any, **options: object) -> None:
            built.append(dict(build.keywords))
            self.pid, self.signal = 0, "reward"

    monkeypatch.setattr(training, "LearnerProcess", FakeLearnerProcess)
    run = thundersync.StreamingRun(tiny_qwen3())
    training.grpo(run=run, process=True, process_device="cuda:1")
    training.grpo(run=run, process=True, process_device="cuda:1", pack_tokens=8192)
    training.grpo(run=run, process=True, process_device="cpu")  # the run's own device
    training.grpo(run=run, process=True)
    assert [b["pack_tokens"] for b in built] == [0, 8192, None, None]  # None: the child's run decides
