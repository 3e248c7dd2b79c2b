"""Streamed OPD gradients equal the dense full-batch gradient, whatever the interleaving."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thundersync
from tests.opd.opd_cases import (
    VOCAB,
    advantage_condition,
    collect_grads,
    dense_reference_grads,
    drive,
    fp64_copy,
    interleaving,
    plans,
    relative_error,
    tiny_qwen3,
)
from thundersync.errors import ConfigError, StreamingError, UnknownIdError, UnsafeStepError

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
FP32_ROUNDOFF = 2.0**-24  # unit roundoff of float32
_MODELS: dict[tuple[torch.dtype, bool], torch.nn.Module] = {}
_FP64_COPIES: dict[int, torch.nn.Module] = {}


def _model(dtype: torch.dtype, lora: bool) -> torch.nn.Module:
    key = (dtype, lora)
    if key not in _MODELS:
        _MODELS[key] = tiny_qwen3(dtype, lora=lora)
    return _MODELS[key]


def _streamed_grads(model: torch.nn.Module, plan, ops, normalization: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model), normalization=normalization)
    for _ in drive(opd, plan, ops):
        pass
    opd.assert_safe_to_step()
    grads = collect_grads(model)
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("normalization", ["token_mean", "sum"])
@pytest.mark.parametrize("with_behaviour", [False, True], ids=["on_policy", "behaviour"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streamed_gradient_equals_dense_reference(
    data: st.DataObject, dtype: torch.dtype, lora: bool, normalization: str, with_behaviour: bool
) -> None:
    """fp32 streams are compared with the fp64 dense gradient of the same weights, within 1e-5
    plus the roundoff that the on-policy advantage lp - q magnifies when a teacher score lands
    near the student's log-prob (opd_cases.advantage_condition): that part is the conditioning
    of the problem, which a dense fp32 computation suffers as much (for the draw that found it,
    q = -4.625 against lp = -4.62236: dense fp32 is 9.4e-5 off the fp64 gradient, the stream
    8.6e-5, so the two fp32 results differ by 1.8e-4 while both are as exact as fp32 allows)."""
    plan = data.draw(plans(with_behaviour=with_behaviour))
    ops = interleaving(plan, random.Random(data.draw(st.integers(0, 2**32))))
    model = _model(dtype, lora)
    tolerance = TOLERANCE[dtype]
    reference = model
    if dtype == torch.float32:
        if id(model) not in _FP64_COPIES:
            _FP64_COPIES[id(model)] = fp64_copy(model)
        reference = _FP64_COPIES[id(model)]
        tolerance += 8 * FP32_ROUNDOFF * advantage_condition(reference, plan)
    want = dense_reference_grads(reference, plan, normalization)
    got = _streamed_grads(model, plan, ops, normalization)
    assert set(got) == set(want)
    assert relative_error(got, want) < tolerance


def _single_trajectory_plan(tokens_by_turn: list[list[int]], scored_by_turn: list[list[bool]]):
    from tests.opd.opd_cases import Group, Trajectory, Turn

    rng = random.Random(0)
    turns = [
        Turn(tokens, scored, [rng.uniform(-4, -0.1) for _ in range(sum(scored))], None)
        for tokens, scored in zip(tokens_by_turn, scored_by_turn)
    ]
    return {"g": Group([1, 2, 3], {"t": Trajectory(turns)})}


def test_a_late_turn_loss_reaches_parameters_only_through_an_early_turns_kv() -> None:
    """Token 96 appears only inside turn 0 (unscored), whose state turn 1 forces into existence.
    Turn 3's loss reaches that token's embedding row only through turn 0's K/V (a proxy by then):
    its part must arrive by the ledger replay when the trajectory closes."""
    special = VOCAB - 1
    tokens = [[5, special, 7, 8], [9, 10], [11, 12], [13, 14, 15]]
    plan = _single_trajectory_plan(tokens, [[False] * 4, [True, True], [False, False], [True, True, True]])
    early = _single_trajectory_plan(tokens, [[False] * 4, [True, True], [False, False], [False] * 3])
    early["g"].trajectories["t"].turns[1] = plan["g"].trajectories["t"].turns[1]  # same teacher scores
    model = _model(torch.float64, False)
    want = dense_reference_grads(model, plan, "sum")["model.embed_tokens.weight"][special]
    want_early = dense_reference_grads(model, early, "sum")["model.embed_tokens.weight"][special]
    assert (want - want_early).abs().sum() > 1e-6 * want.abs().sum(), "the late turn must matter"

    model.zero_grad(set_to_none=True)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model), normalization="sum")
    opd.open_group("g", plan["g"].prompt)
    for turn in plan["g"].trajectories["t"].turns:
        opd.append_turn("g", "t", turn.tokens, turn.scored, teacher_logprobs=turn.teacher if any(turn.scored) else None)
    embedding = model.get_input_embeddings().weight
    assert embedding.grad is not None
    torch.testing.assert_close(embedding.grad[special], want_early, rtol=1e-10, atol=1e-14)  # no replay yet
    opd.close_trajectory("g", "t")
    opd.close_group("g")
    opd.assert_safe_to_step()
    torch.testing.assert_close(embedding.grad[special], want, rtol=1e-10, atol=1e-14)
    model.zero_grad(set_to_none=True)


def test_retained_memory_returns_to_zero_after_each_trajectory_closes() -> None:
    model = _model(torch.float32, False)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model))
    opd.open_group("g", [1, 2, 3, 4])
    group_level = None  # the prompt's state and ledger: held until the group closes
    for tid in range(4):
        before = opd.retained_bytes()
        opd.append_turn("g", tid, [5, 6, 7], [True, False, True], teacher_logprobs=[-1.0, -2.0])
        opd.append_turn("g", tid, [8, 9], [False, False])
        opd.append_turn("g", tid, [10, 11, 12], [True, True, True], teacher_logprobs=[-1.0, -2.0, -3.0])
        assert opd.retained_bytes() > before
        opd.close_trajectory("g", tid)
        group_level = group_level or opd.retained_bytes()
        assert opd.retained_bytes() == group_level
    opd.close_group("g")
    assert opd.retained_bytes() == 0
    opd.assert_safe_to_step()
    model.zero_grad(set_to_none=True)


def test_existing_grad_is_added_to_not_replaced() -> None:
    plan = _single_trajectory_plan([[5, 6, 7], [8, 9]], [[True, True, False], [False, True]])
    model = _model(torch.float64, False)
    want = dense_reference_grads(model, plan, "token_mean")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model))
    for _ in drive(opd, plan, interleaving(plan, random.Random(1))):
        pass
    opd.assert_safe_to_step()
    got = {k: v - 1.0 for k, v in collect_grads(model).items()}
    assert relative_error(got, want) < 1e-10
    model.zero_grad(set_to_none=True)


# --- errors ---------------------------------------------------------------------------------


@pytest.fixture
def opd() -> Iterator[thundersync.OPDStream]:
    model = _model(torch.float32, False)
    model.zero_grad(set_to_none=True)
    stream = thundersync.OPDStream(thundersync.StreamingRun(model))
    stream.open_group("g", [1, 2])
    yield stream
    stream.discard()  # the shared model's parameters are free for the next test's batch


def test_teacher_logprobs_of_the_wrong_length_are_refused(opd: thundersync.OPDStream) -> None:
    with pytest.raises(ConfigError, match=r"teacher_logprobs has 1 entries but the turn has 2 scored tokens"):
        opd.append_turn("g", "t", [3, 4, 5], [True, False, True], teacher_logprobs=[-1.0])


def test_a_scored_turn_without_teacher_logprobs_is_refused(opd: thundersync.OPDStream) -> None:
    with pytest.raises(ConfigError, match=r"teacher_logprobs are required: the turn has 1 scored tokens"):
        opd.append_turn("g", "t", [3, 4], [True, False])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_teacher_or_behaviour_logprobs_are_refused(opd: thundersync.OPDStream, bad: float) -> None:
    with pytest.raises(ConfigError, match=r"teacher_logprobs\[1\] is (nan|inf|-inf)"):
        opd.append_turn("g", "t", [3, 4], [True, True], teacher_logprobs=[-1.0, bad])
    with pytest.raises(ConfigError, match=r"behaviour_logprobs\[0\] is (nan|inf|-inf)"):
        opd.append_turn("g", "t", [3, 4], [True, True], teacher_logprobs=[-1.0, -1.0], behaviour_logprobs=[bad, -1.0])


def test_appending_after_close_is_refused(opd: thundersync.OPDStream) -> None:
    opd.append_turn("g", "t", [3, 4], [True, False], teacher_logprobs=[-1.0])
    opd.close_trajectory("g", "t")
    with pytest.raises(StreamingError, match=r"trajectory 't' of group 'g' is closed"):
        opd.append_turn("g", "t", [5], [False])
    with pytest.raises(StreamingError, match=r"trajectory 't' of group 'g' is closed"):
        opd.close_trajectory("g", "t")


def test_unknown_ids_are_refused(opd: thundersync.OPDStream) -> None:
    with pytest.raises(UnknownIdError, match=r"group 'nope' is not open"):
        opd.append_turn("nope", "t", [3], [False])
    with pytest.raises(UnknownIdError, match=r"trajectory 'zz' of group 'g' has no turn \(never appended to\)"):
        opd.close_trajectory("g", "zz")


def test_stepping_with_open_groups_or_unreplayed_ledgers_names_them(opd: thundersync.OPDStream) -> None:
    opd.append_turn("g", "t", [3, 4], [False, False])
    opd.append_turn("g", "t", [5, 6], [True, True], teacher_logprobs=[-1.0, -2.0])
    with pytest.raises(
        UnsafeStepError,
        match=r"open groups: 'g'.*unclosed trajectories: 'g'/'t'.*unreplayed ledgers: 'g'/'t' turns \[0\]",
    ):
        opd.assert_safe_to_step()


def test_a_model_with_active_dropout_in_training_mode_is_refused() -> None:
    model = tiny_qwen3(torch.float32)
    model.config.attention_dropout = 0.1
    model.train()
    opd = thundersync.OPDStream(thundersync.StreamingRun(model))
    with pytest.raises(ConfigError, match=r"training mode with active attention_dropout=0.1.*model.eval\(\)"):
        opd.open_group("g", [1, 2])


def test_a_bf16_model_accumulates_in_fp32_and_matches_the_fp32_reference() -> None:
    """Low-precision parameters: gradients gather in an fp32 accumulator, reaching .grad at the step."""
    plan = _single_trajectory_plan(
        [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14]],
        [[True, False, True, True], [False, False], [True, True, True, False]],
    )
    reference = tiny_qwen3(torch.float32)
    want = dense_reference_grads(reference, plan, "token_mean")
    model = tiny_qwen3(torch.float32).to(torch.bfloat16)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model))
    for kind, *_ in drive(opd, plan, interleaving(plan, random.Random(2))):
        if kind == "append":
            assert all(p.grad is None for p in model.parameters()), "bf16 .grad is written once, at the step"
    opd.assert_safe_to_step()
    got = collect_grads(model)
    assert all(g.dtype == torch.bfloat16 for g in got.values())
    assert relative_error(got, want) < 2e-2


def test_a_batch_abandoned_without_discard_leaves_nothing_in_the_next_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an abandoned batch's graphed packs left in the model's graph totals (its run collected,
    so its claims ended) is zeroed when the next batch begins, not drained into it."""
    from thundersync.engine.accel import _pack_graphs as _pack_graph
    from thundersync.model.anatomy import decoder_anatomy

    plan = _single_trajectory_plan(
        [[5, 6, 7], [9, 10], [11, 12, 13]], [[True, False, True], [False, False], [True] * 3]
    )
    model = tiny_qwen3(torch.float32).to(torch.bfloat16)
    want = _streamed_grads(model, plan, list(interleaving(plan, random.Random(2))), "token_mean")
    graphs = _pack_graph.PackGraphs(decoder_anatomy(model))
    params = [p for p in model.parameters() if p.requires_grad]
    for total in graphs.total_buffers(params).values():
        total.fill_(1.0)  # the abandoned batch's sums
    graphs.pending = True
    monkeypatch.setitem(_pack_graph._models, model, graphs)
    got = _streamed_grads(model, plan, list(interleaving(plan, random.Random(2))), "token_mean")
    assert not graphs.pending
    for name, g in got.items():
        assert torch.equal(g, want[name]), name


def _agent_plan(rng: random.Random, turns: Callable[[], int]):  # type: ignore[no-untyped-def]
    """2 groups x 4 trajectories of ``turns()`` turns each, actions (mostly scored) and
    observations alternating."""
    from tests.opd.opd_cases import Group, Trajectory, Turn

    def turn(action: bool) -> Turn:
        tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        scored = [action and rng.random() < 0.8 for _ in tokens]
        return Turn(tokens, scored, [rng.uniform(-5, -0.1) for _ in range(sum(scored))], None)

    return {
        f"g{g}": Group(
            [rng.randrange(VOCAB) for _ in range(5)],
            {f"t{i}": Trajectory([turn(k % 2 == 0) for k in range(turns())]) for i in range(4)},
        )
        for g in range(2)
    }


def test_background_work_packs_queued_turns_and_still_equals_the_dense_reference() -> None:
    plan = _agent_plan(random.Random(5), lambda: 5)
    model = _model(torch.float64, False)
    want = dense_reference_grads(model, plan, "token_mean")
    model.zero_grad(set_to_none=True)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model, background=True))
    for _ in drive(opd, plan, interleaving(plan, random.Random(3))):
        pass
    opd.assert_safe_to_step()
    assert relative_error(collect_grads(model), want) < 1e-10
    model.zero_grad(set_to_none=True)


def test_trajectories_closed_while_the_worker_is_busy_replay_together_level_by_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Everything is queued behind a held worker, so each job finds many turns and many closed
    trajectories waiting: turns pack one per trajectory, replays pack across trajectories."""
    from thundersync.opd import _replay

    rng = random.Random(11)
    plan = _agent_plan(rng, lambda: rng.randint(1, 5))
    model = _model(torch.float64, False)
    want = dense_reference_grads(model, plan, "token_mean")
    model.zero_grad(set_to_none=True)
    replayed: list[int] = []
    real = _replay.replay_trajectories
    monkeypatch.setattr(
        _replay,
        "replay_trajectories",
        lambda run, sink, closed: (replayed.append(len(closed)), real(run, sink, closed)),
    )
    run = thundersync.StreamingRun(model, background=True)
    opd = thundersync.OPDStream(run)
    release = threading.Event()
    run.submit("hold the worker", lambda: release.wait(30))
    for _ in drive(opd, plan, interleaving(plan, random.Random(5))):
        pass
    release.set()
    opd.assert_safe_to_step()
    assert relative_error(collect_grads(model), want) < 1e-10
    model.zero_grad(set_to_none=True)
    assert sum(replayed) == 8 and max(replayed) > 1, replayed


def test_the_pack_queue_takes_a_ready_fifo_prefix_with_one_item_per_trajectory_and_a_token_limit() -> None:
    from thundersync.engine.packing import PackQueue
    from thundersync.opd._replay import PendingTurn, PromptState, TurnChain, TurnState

    group = PromptState([1])
    a, b, c = TurnChain(), TurnChain(), TurnChain()

    def item(trajectory: TurnChain, length: int) -> PendingTurn:
        return PendingTurn(group, [], TurnState([0] * length, [0], None, None), trajectory)

    blocked: set[int] = set()
    queue = PackQueue[PendingTurn](20, size=len, owner=lambda it: it.trajectory, ready=lambda it: id(it) not in blocked)
    items = [item(a, 4), item(b, 4), item(a, 4), item(c, 4)]
    for it in items:
        queue.push(it)
    assert queue.holds(a) and queue.holds(c)
    assert queue.take() == items[:2]  # stops at the second turn of trajectory a
    assert queue.take() == items[2:]
    assert queue.take() == [] and not queue.holds(a)
    big = [item(a, 15), item(b, 15), item(c, 30), item(a, 1)]
    blocked.add(id(big[1]))
    for it in big:
        queue.push(it)
    assert queue.take() == big[:1]  # the next one is not ready: nothing behind it is taken
    blocked.clear()
    assert queue.take() == big[1:2]  # 16 + 31 tokens would pass the limit of 20
    assert queue.take() == big[2:3]  # a turn over the limit still runs, alone
    assert queue.take() == big[3:]
