"""A run's logical batches: ownership, failure and recovery, and models peft can make awkward."""

from __future__ import annotations

import random

import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from tests.grpo import grpo_cases as G
from tests.opd import opd_cases as O
from thundersync.errors import ConfigError, StreamingError, UnsafeStepError


def _grpo_plan() -> list[G.Group]:
    rng = random.Random(11)

    def traj(reward: float) -> G.Trajectory:
        turns = [
            G.Turn([rng.randrange(G.VOCAB) for _ in range(4)], [True, True, False, True]),
            G.Turn([rng.randrange(G.VOCAB) for _ in range(3)], [False] * 3),
            G.Turn([rng.randrange(G.VOCAB) for _ in range(3)], [True] * 3),
        ]
        return G.Trajectory(turns, reward)

    return [G.Group([rng.randrange(G.VOCAB) for _ in range(6)], [traj(r) for r in (1.0, 0.0, 2.0, 1.0)])]


def _feed_grpo(grpo: thundersync.RewardLinearBackward, plan: list[G.Group]) -> None:
    for g, group in enumerate(plan):
        grpo.open_group(g, group.prompt)
        for i, traj in enumerate(group.trajectories):
            for turn in traj.turns:
                grpo.append_turn(g, i, turn.tokens, turn.scored)
            grpo.close_trajectory(g, i, traj.reward)
        grpo.close_group(g)


def _stream_grpo(grpo: thundersync.RewardLinearBackward, plan: list[G.Group]) -> None:
    _feed_grpo(grpo, plan)
    grpo.assert_safe_to_step()


def _dense_grpo(model: torch.nn.Module, plan: list[G.Group]) -> list[torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    G.dense_objective(model, plan, "grpo", 1e-6).backward()
    want = G.grads(model)
    model.zero_grad(set_to_none=True)
    return want


def _opd_plan() -> O.Plan:
    rng = random.Random(12)

    def turn(action: bool) -> O.Turn:
        tokens = [rng.randrange(O.VOCAB) for _ in range(4)]
        scored = [action] * 4
        return O.Turn(tokens, scored, [rng.uniform(-4, -0.1) for _ in range(sum(scored))], None)

    return {
        f"g{g}": O.Group(
            [rng.randrange(O.VOCAB) for _ in range(5)],
            {f"t{i}": O.Trajectory([turn(k % 2 == 0) for k in range(3)]) for i in range(2)},
        )
        for g in range(2)
    }


def _feed_opd(opd: thundersync.OPDStream, plan: O.Plan, seed: int = 0) -> None:
    for _ in O.drive(opd, plan, O.interleaving(plan, random.Random(seed))):
        pass


def _stream_opd(opd: thundersync.OPDStream, plan: O.Plan, seed: int = 0) -> None:
    _feed_opd(opd, plan, seed)
    opd.assert_safe_to_step()


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["embed_tokens", "k_proj"]], ids=["q_v", "embed_k"])
def test_lora_that_leaves_some_kv_without_graph_streams_exact_gradients(targets: list[str]) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_qwen3(torch.float64), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0.0, 0.2)
    plan = _grpo_plan()
    want = _dense_grpo(model, plan)
    _stream_grpo(thundersync.RewardLinearBackward(thundersync.StreamingRun(model), pack_tokens=8), plan)
    assert G.relative_error(G.grads(model), want) < 1e-10
    model.zero_grad(set_to_none=True)

    opd_plan = _opd_plan()
    want_opd = O.dense_reference_grads(model, opd_plan, "token_mean")
    _stream_opd(thundersync.OPDStream(thundersync.StreamingRun(model)), opd_plan)
    assert O.relative_error(O.collect_grads(model), want_opd) < 1e-10


def test_background_opd_never_runs_a_turn_before_its_groups_prompt() -> None:
    model = tiny_qwen3(torch.float64)
    plan = {
        "A": O.Group(list(range(1, 40)), {0: O.Trajectory([O.Turn([5, 6, 7], [True] * 3, [-1.0] * 3, None)])}),
        "B": O.Group(list(range(2, 40)), {0: O.Trajectory([O.Turn([8, 9], [True] * 2, [-2.0] * 2, None)])}),
    }
    want = O.dense_reference_grads(model, plan, "token_mean")
    for _ in range(10):  # the race needs B's turn queued while A's first job waits
        opd = thundersync.OPDStream(thundersync.StreamingRun(model, background=True))
        opd.open_group("A", plan["A"].prompt)
        opd.append_turn("A", 0, [5, 6, 7], [True] * 3, teacher_logprobs=[-1.0] * 3)
        opd.open_group("B", plan["B"].prompt)
        opd.append_turn("B", 0, [8, 9], [True] * 2, teacher_logprobs=[-2.0] * 2)
        for g in ("A", "B"):
            opd.close_trajectory(g, 0)
            opd.close_group(g)
        opd.assert_safe_to_step()
        assert O.relative_error(O.collect_grads(model), want) < 1e-10
        model.zero_grad(set_to_none=True)


def test_teacher_scores_are_copied_when_the_turn_is_appended() -> None:
    model = tiny_qwen3(torch.float64)
    plan = _opd_plan()
    want = O.dense_reference_grads(model, plan, "token_mean")
    opd = thundersync.OPDStream(thundersync.StreamingRun(model, background=True))
    buffer = torch.empty(4, dtype=torch.float64)
    for kind, gid, tid, k in O.interleaving(plan, random.Random(0)):
        if kind == "append":
            turn = plan[gid].trajectories[tid].turns[k]
            teacher = None
            if any(turn.scored):
                buffer.copy_(torch.tensor(turn.teacher, dtype=torch.float64))
                teacher = buffer
            opd.append_turn(gid, tid, turn.tokens, turn.scored, teacher_logprobs=teacher)
            buffer.fill_(123.0)  # the caller reuses its buffer at once
        else:
            list(O.drive(opd, plan, [(kind, gid, tid, k)]))
    opd.assert_safe_to_step()
    assert O.relative_error(O.collect_grads(model), want) < 1e-10


def test_a_second_objective_cannot_join_a_running_batch_but_may_take_the_next() -> None:
    run = thundersync.StreamingRun(tiny_qwen3(torch.float32))
    grpo = thundersync.RewardLinearBackward(run)
    opd = thundersync.OPDStream(run)
    grpo.open_group("g", [1, 2, 3])
    with pytest.raises(ConfigError, match=r"in a logical batch of another objective \(RewardLinearBackward\)"):
        opd.open_group("h", [1, 2])
    grpo.append_turn("g", 0, [4, 5], [True, True])
    grpo.close_trajectory("g", 0, 1.0)
    grpo.close_group("g")
    grpo.assert_safe_to_step()
    opd.open_group("h", [1, 2])  # the run is free again


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_moved_parameters_drop_the_batch_and_the_next_batch_is_exact(objective: str) -> None:
    model = tiny_qwen3(torch.float64)
    earlier = {name: torch.full_like(p, 0.5) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = earlier[name].clone()
    run = thundersync.StreamingRun(model)
    if objective == "grpo":
        grpo = thundersync.RewardLinearBackward(run)
        plan_g = _grpo_plan()
        _feed_grpo(grpo, plan_g)
        obj: thundersync.RewardLinearBackward | thundersync.OPDStream = grpo
    else:
        opd = thundersync.OPDStream(run)
        plan_o = _opd_plan()
        _feed_opd(opd, plan_o)
        obj = opd
    with torch.no_grad():  # a user mistake: the values come back, the version counter does not
        model.lm_head.weight.add_(1.0)
        model.lm_head.weight.sub_(1.0)
    with pytest.raises(UnsafeStepError, match=r"modified in place since the batch began: lm_head.weight.*dropped"):
        obj.assert_safe_to_step()
    for name, p in model.named_parameters():  # nothing of the dropped batch reached .grad
        torch.testing.assert_close(p.grad, earlier[name], rtol=0, atol=0)
    model.zero_grad(set_to_none=True)
    if objective == "grpo":  # the same objective and run go on with a new, exact batch
        want = _dense_grpo(model, plan_g)
        _stream_grpo(grpo, plan_g)
        assert G.relative_error(G.grads(model), want) < 1e-10
    else:
        want_o = O.dense_reference_grads(model, plan_o, "token_mean")
        _stream_opd(opd, plan_o)
        assert O.relative_error(O.collect_grads(model), want_o) < 1e-10


def test_a_failed_job_is_discarded_and_the_run_goes_on_with_grad_restored() -> None:
    model = tiny_qwen3(torch.float64)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    failures = [RuntimeError("device lost (simulated by a user hook)")]

    def hook(module: torch.nn.Module, args: object, output: object) -> None:
        if failures:
            raise failures.pop()

    handle = model.model.layers[1].mlp.register_forward_hook(hook)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model))
    plan = _opd_plan()
    with pytest.raises(StreamingError, match=r"engine work failed in .*device lost.*call discard\(\)") as failed:
        _stream_opd(opd, plan)
    assert isinstance(failed.value.__cause__, RuntimeError)
    with pytest.raises(StreamingError, match=r"engine work failed in .*device lost"):  # until discarded
        opd.open_group("again", [1, 2])
    opd.discard()
    handle.remove()
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.parameters())
    model.zero_grad(set_to_none=True)
    want = O.dense_reference_grads(model, plan, "token_mean")
    _stream_opd(opd, plan)
    assert O.relative_error(O.collect_grads(model), want) < 1e-10


def test_objectives_work_when_called_under_inference_mode() -> None:
    """A caller that generates under torch.inference_mode() may feed the objective from there."""
    model = tiny_qwen3(torch.float64)
    plan = _grpo_plan()
    want = _dense_grpo(model, plan)
    with torch.inference_mode():
        _stream_grpo(thundersync.RewardLinearBackward(thundersync.StreamingRun(model)), plan)
    assert G.relative_error(G.grads(model), want) < 1e-10
