"""GRPO and OPD report the mean |behaviour - learner| log-prob of the scored tokens they forwarded."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import thundersync
from tests.engine.test_distributed import _connect, _spawn
from tests.engine.tiny_models import tiny_qwen3
from thundersync.engine.mismatch import LogprobMismatch
from thundersync.errors import ConfigError

PROMPT = [1, 2, 3]
# trajectory -> turns of (tokens, scored flags, behaviour offsets of the scored tokens or None)
TURNS: dict[int, list[tuple[list[int], list[bool], list[float] | None]]] = {
    0: [
        ([4, 5, 6], [True, False, True], [0.5, -0.25]),
        ([7, 8], [False, False], None),
        ([9, 10], [True] * 2, [0.125, -1.0]),
    ],
    1: [([11, 12, 13], [True] * 3, None), ([14], [True], [2.0])],  # its first action has no behaviour log-probs
}
OFFSETS = [0.5, -0.25, 0.125, -1.0, 2.0]


def _learner_logprobs(model: torch.nn.Module, trajectory: int) -> list[float]:
    """The model's log-prob of each scored token of a trajectory, by one dense forward."""
    tokens, scored = list(PROMPT), [False] * len(PROMPT)
    for ids, flags, _ in TURNS[trajectory]:
        tokens, scored = tokens + ids, scored + flags
    ids_t = torch.tensor(tokens)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids_t[None]).logits[0], -1)
    lp = logp[:-1].gather(-1, ids_t[1:, None])[:, 0]
    return [float(x) for x, keep in zip(lp, scored[1:]) if keep]


def _stream(objective: Any, model: torch.nn.Module, *, with_behaviour: bool = True) -> None:
    """One group of two trajectories; behaviour = learner + offset where an offset is given."""
    grpo = objective.signal == "reward"
    objective.open_group("g", PROMPT)
    for t, turns in TURNS.items():
        learner = iter(_learner_logprobs(model, t))
        for ids, flags, offsets in turns:
            mine = [next(learner) for keep in flags if keep]
            behaviour = None if offsets is None or not with_behaviour else [x + d for x, d in zip(mine, offsets)]
            teacher = None if grpo or not mine else [x - 0.5 for x in mine]
            objective.append_turn("g", t, ids, flags, teacher_logprobs=teacher, behaviour_logprobs=behaviour)
        objective.close_trajectory("g", t, float(t) if grpo else None)
    objective.close_group("g")
    objective.assert_safe_to_step()


@pytest.mark.parametrize("make", [thundersync.RewardLinearBackward, thundersync.OPDStream], ids=["grpo", "opd"])
@pytest.mark.parametrize("pack_tokens", [0, 8192])
def test_injected_offsets_come_back_as_their_mean_absolute_value(make: Any, pack_tokens: int) -> None:
    model = tiny_qwen3(torch.float64)
    objective = make(thundersync.StreamingRun(model), pack_tokens=pack_tokens)
    _stream(objective, model)
    mismatch = objective.take_logprob_mismatch()
    assert mismatch is not None
    assert abs(mismatch - sum(abs(d) for d in OFFSETS) / len(OFFSETS)) < 1e-12
    assert objective.take_logprob_mismatch() is None  # taken: reset


def test_behaviour_logprobs_leave_the_grpo_gradient_bitwise_unchanged() -> None:
    model = tiny_qwen3(torch.float64)
    plain = copy.deepcopy(model)
    _stream(thundersync.RewardLinearBackward(thundersync.StreamingRun(model)), model)
    _stream(thundersync.RewardLinearBackward(thundersync.StreamingRun(plain)), plain, with_behaviour=False)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad)


def test_grpo_reports_none_without_behaviour_logprobs_and_forgets_a_discarded_batch() -> None:
    model = tiny_qwen3(torch.float64)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), pack_tokens=0)
    _stream(grpo, model, with_behaviour=False)
    assert grpo.take_logprob_mismatch() is None
    grpo.open_group("h", PROMPT)
    grpo.append_turn("h", 0, [4, 5], [True, True], behaviour_logprobs=[-1.0, -2.0])
    grpo.close_trajectory("h", 0, 1.0)  # pack_tokens=0: forwarded now, its gap measured
    grpo.discard()
    assert grpo.take_logprob_mismatch() is None


def test_grpo_still_refuses_teacher_logprobs_and_checks_behaviour_logprobs() -> None:
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(tiny_qwen3(torch.float64)))
    grpo.open_group("g", PROMPT)
    with pytest.raises(ConfigError, match="not teacher log-probs: leave teacher_logprobs unset"):
        grpo.append_turn("g", 0, [4], [True], teacher_logprobs=[-1.0])
    with pytest.raises(ConfigError, match="behaviour_logprobs has 1 entries but the turn has 2 scored tokens"):
        grpo.append_turn("g", 0, [4, 5], [True, True], behaviour_logprobs=[-1.0])


def test_the_meter_averages_only_known_behaviour_logprobs() -> None:
    meter = LogprobMismatch()
    meter.add(torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64), torch.tensor([-1.5, float("nan"), -2.0]))
    meter.add(torch.tensor([-1.0]), None)
    assert meter.take() == pytest.approx(0.75, abs=1e-15)
    assert meter.take() is None


def _rank(rank: int, world_size: int, port: int, out: Any) -> None:
    from thundersync.engine.distributed import DataParallel

    store = _connect(rank, world_size, port)
    meter = LogprobMismatch()
    for k in range(rank + 1):  # rank 0: one gap of 1.0; rank 1: two gaps, 1.0 and 4.0
        meter.add(torch.tensor([0.0], dtype=torch.float64), torch.tensor([1.0 + 3.0 * k], dtype=torch.float64))
    out.put((rank, meter.take(DataParallel(store=store, timeout_s=60))))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_under_data_parallel_every_rank_reports_the_global_mean() -> None:
    results, exitcodes, _ = _spawn(_rank, 2)
    assert exitcodes == [0, 0]
    assert sorted(results) == [(0, 2.0), (1, 2.0)]  # (1 + 1 + 4) / 3, not a mean of the ranks' means
