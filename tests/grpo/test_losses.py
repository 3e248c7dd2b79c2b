"""The staleness-correcting loss forms, streamed, equal their dense definitions written another way.

The reference here is plain full-batch autograd: every trajectory through the model's ordinary
forward, the proximal log-probs from a frozen copy of the model (not a detached graph), the
behaviour log-probs from older versions of the model (copies moved by different amounts, so one
batch mixes several versions), and each loss written as its paper's code writes it (a loss to
minimize, masks over padded tokens). Planted errors (a wrong version's log-probs, a clip on the
wrong side) must move the streamed gradient away from it.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thundersync
from tests.engine.tiny_models import tiny_qwen3, with_lora
from tests.grpo.grpo_cases import Group, advantages, grads, groups, interleaving, relative_error
from thundersync.errors import ConfigError
from thundersync.grpo import losses
from thundersync.grpo.stream import reference_scorer
from thundersync.model.anatomy import adapter_lock
from thundersync.model.scoring import PackedScorer

EPS = 1e-6
VERSIONS = 3


def sequence(group: Group, i: int) -> tuple[list[int], list[bool]]:
    tokens, scored = list(group.prompt), [False] * len(group.prompt)
    for turn in group.trajectories[i].turns:
        tokens += turn.tokens
        scored += turn.scored
    return tokens, scored


def scored_logprobs(model: torch.nn.Module, tokens: list[int], scored: list[bool]) -> torch.Tensor:
    ids = torch.tensor(tokens)
    logits = model(input_ids=ids[None]).logits[0]
    logp = torch.log_softmax(logits.double() if logits.dtype == torch.float64 else logits.float(), -1)
    return logp[:-1].gather(-1, ids[1:, None])[:, 0][torch.tensor(scored[1:], dtype=torch.bool)]


def versions(model: torch.nn.Module, seed: int) -> list[torch.nn.Module]:
    """Older policies: copies of ``model`` with every trainable parameter moved by noise of a
    different size per version."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for v in range(VERSIONS):
        old = copy.deepcopy(model)
        with torch.no_grad():
            for p in old.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.05 * (v + 1))
        out.append(old)
    return out


def behaviour_logprobs(model: torch.nn.Module, plan: list[Group], seed: int) -> tuple[list[list[torch.Tensor]], list]:
    """Per trajectory the log-probs of its scored tokens under the version that generated it, and
    which version that was (trajectory i of group g: version (g + i + seed) mod VERSIONS)."""
    olds = versions(model, seed)
    out, which = [], []
    with torch.no_grad():
        for g, group in enumerate(plan):
            out.append([])
            which.append([])
            for i in range(len(group.trajectories)):
                v = (g + i + seed) % VERSIONS
                out[-1].append(scored_logprobs(olds[v], *sequence(group, i)).double())
                which[-1].append(v)
    return out, which


def reference_logprobs(
    model: torch.nn.Module, reference: torch.nn.Module | None, tokens: list[int], scored: list[bool]
) -> torch.Tensor:
    """The KL reference's log-probs: ``reference`` through its ordinary forward, or ``model``'s
    base model (peft's disable_adapter) when none is given."""
    with torch.no_grad():
        if reference is not None:
            return scored_logprobs(reference, tokens, scored)
        with model.disable_adapter():  # type: ignore[operator]
            return scored_logprobs(model, tokens, scored)


def dense_loss(
    model: torch.nn.Module,
    plan: list[Group],
    behaviour: list[list[torch.Tensor]],
    options: dict,
    estimator: str,
    reference: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, dict[str, float] | None]:
    """The batch's loss (= -J) and its statistics (importance weights, KL), written as the papers' code."""
    frozen = copy.deepcopy(model)
    loss_name = options.get("loss", "grpo")
    kl_coef = options.get("kl_coef", 0.0)
    total = []
    weights: list[torch.Tensor] = []
    clipped: list[torch.Tensor] = []
    kls: list[torch.Tensor] = []
    for g, group in enumerate(plan):
        adv = advantages([t.reward for t in group.trajectories], estimator, EPS)
        if len(set(t.reward for t in group.trajectories)) == 1 and not kl_coef:
            continue  # every advantage is zero: nothing forwarded, nothing counted
        for i, a in enumerate(adv):
            tokens, scored = sequence(group, i)
            if not any(scored[len(group.prompt) :]):
                continue
            lp = scored_logprobs(model, tokens, scored)
            with torch.no_grad():
                prox = scored_logprobs(frozen, tokens, scored)
            b = behaviour[g][i].to(lp.dtype)
            if kl_coef:  # Schulman's estimators of KL(pi || ref) from samples
                ref = reference_logprobs(model, reference, tokens, scored)
                log_ratio = ref - lp
                k = -log_ratio if options.get("kl_estimator", "k3") == "k1" else log_ratio.exp() - 1 - log_ratio
                total.append(kl_coef * k.sum())
                kls.append(k.detach())
            if loss_name == "grpo":
                total.append(-(a * lp).sum())
            elif loss_name == "tis":  # Yao et al.: min(pi_fsdp / pi_vllm, C) * A * grad log pi
                ratio = torch.exp(prox - b)
                total.append(-(torch.clamp(ratio, max=options.get("tis_cap", 2.0)) * a * lp).sum())
                weights.append(ratio)
                clipped.append(ratio > options.get("tis_cap", 2.0))
            elif loss_name == "ppo_decoupled":  # AReaL's ppo_actor_loss_fn
                ratio = torch.exp(lp - prox)
                pg1 = -a * ratio
                pg2 = -a * torch.clamp(ratio, 1.0 - options.get("clip_low", 0.2), 1.0 + options.get("clip_high", 0.2))
                pg = torch.max(pg1, pg2)
                behav = torch.exp(prox - b)
                cap = options.get("behaviour_cap")
                mask = behav <= cap if cap is not None else torch.ones_like(behav, dtype=torch.bool)
                total.append((pg * torch.where(mask, behav, 0.0)).sum())
                weights.append(behav)
                clipped.append(~mask | (pg1.detach() < pg2.detach()))
            else:  # GSPO: s_i = (pi / pi_old)^(1/|y|)
                s = torch.exp((lp - b).sum() / len(lp))
                pg1, pg2 = (
                    -a * s,
                    -a * torch.clamp(s, 1.0 - options.get("clip_low", 0.2), 1.0 + options.get("clip_high", 0.2)),
                )
                total.append(torch.max(pg1, pg2))
                weights.append(s.detach().reshape(1))
                clipped.append((pg1.detach() < pg2.detach()).reshape(1))
    if not total:
        return torch.zeros((), dtype=torch.float64), None
    stats = {}
    if weights:
        w = torch.cat([x.detach().double() for x in weights])
        c = torch.cat(clipped).double()
        stats = {"is_mean": float(w.mean()), "is_max": float(w.max()), "is_clip_fraction": float(c.mean())}
    if kls:
        stats["kl"] = float(torch.cat(kls).mean())
    return torch.stack(total).sum(), stats or None


def stream(
    model: torch.nn.Module,
    plan: list[Group],
    behaviour: list[list[torch.Tensor]],
    options: dict,
    estimator: str,
    seed: int,
    *,
    pack_tokens: int,
    background: bool,
    reference: torch.nn.Module | None = None,
) -> dict[str, float] | None:
    run = thundersync.StreamingRun(model, background=background)
    grpo = thundersync.RewardLinearBackward(
        run, eps=EPS, estimator=estimator, pack_tokens=pack_tokens, stream_early=True, reference=reference, **options
    )
    done: dict[tuple[int, int], int] = {}
    for op in interleaving(plan, random.Random(seed)):
        if op[0] == "open":
            grpo.open_group(f"g{op[1]}", plan[op[1]].prompt)
        elif op[0] == "append":
            turn = plan[op[1]].trajectories[op[2]].turns[op[3]]
            start = done.get((op[1], op[2]), 0)
            done[op[1], op[2]] = start + sum(turn.scored)
            mine = behaviour[op[1]][op[2]][start : start + sum(turn.scored)]
            grpo.append_turn(f"g{op[1]}", op[2], turn.tokens, turn.scored, behaviour_logprobs=mine.tolist())
        elif op[0] == "close":
            grpo.close_trajectory(f"g{op[1]}", op[2], plan[op[1]].trajectories[op[2]].reward)
        else:
            grpo.close_group(f"g{op[1]}")
    grpo.assert_safe_to_step()
    return grpo.take_objective_stats()


def shift(behaviour: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Planted: the behaviour log-probs of a wrong version (every token's 0.3 nats lower)."""
    return [[b - 0.3 for b in group] for group in behaviour]


OPTIONS = st.sampled_from(
    [
        {"loss": "tis", "tis_cap": 1.05},
        {"loss": "tis", "tis_cap": 2.0},
        {"loss": "ppo_decoupled", "clip_low": 0.2, "clip_high": 0.28},
        {"loss": "ppo_decoupled", "clip_low": 0.1, "clip_high": 0.1, "behaviour_cap": 1.1},
        {"loss": "gspo", "clip_low": 0.02, "clip_high": 0.03},
        {"loss": "gspo", "clip_low": 0.2, "clip_high": 0.2},
    ]
)


def case(lora: bool, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    base = tiny_qwen3(torch.float64, seed=seed % 3)
    model = with_lora(base) if lora else base
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(groups(), min_size=1, max_size=3),
    options=OPTIONS,
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
    seed=st.integers(0, 2**16),
    pack_tokens=st.sampled_from([0, 12, 10_000]),
    background=st.booleans(),
)
def test_streamed_loss_forms_equal_their_dense_definition_in_fp64(
    lora: bool, plan: list[Group], options: dict, estimator: str, seed: int, pack_tokens: int, background: bool
) -> None:
    model, reference = case(lora, seed)
    behaviour, _ = behaviour_logprobs(model, plan, seed)
    loss, want = dense_loss(reference, plan, behaviour, options, estimator)
    if loss.requires_grad:
        (-loss).backward()  # the stream adds grad J, J = -loss
    got = stream(model, plan, behaviour, options, estimator, seed, pack_tokens=pack_tokens, background=background)
    assert relative_error(grads(model), grads(reference)) < 1e-10
    if want is None:
        assert got is None
    else:
        assert got is not None
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key


def fixed_plan() -> list[Group]:
    """Two groups with distinct rewards and several scored tokens per trajectory."""
    rng = random.Random(7)
    from tests.grpo.grpo_cases import Trajectory, Turn

    def trajectory(reward: float) -> Trajectory:
        turns = [Turn([rng.randrange(97) for _ in range(6)], [True] * 6) for _ in range(2)]
        return Trajectory(turns, reward)

    return [Group([1, 2, 3], [trajectory(r) for r in (1.0, 0.0, 0.5, -1.0)]) for _ in range(2)]


@pytest.mark.parametrize(
    "options",
    [
        {"loss": "tis", "tis_cap": 1.2},
        {"loss": "ppo_decoupled", "behaviour_cap": 1.2},
        {"loss": "gspo", "clip_low": 0.02, "clip_high": 0.03},
    ],
    ids=["tis", "ppo_decoupled", "gspo"],
)
def test_a_wrong_versions_logprobs_are_caught_by_the_dense_reference(options: dict) -> None:
    plan = fixed_plan()
    model, reference = case(False, 0)
    behaviour, _ = behaviour_logprobs(model, plan, 0)
    loss, _ = dense_loss(reference, plan, behaviour, options, "grpo")
    (-loss).backward()
    stream(model, plan, behaviour, options, "grpo", 0, pack_tokens=0, background=False)
    assert relative_error(grads(model), grads(reference)) < 1e-10
    for p in model.parameters():
        p.grad = None
    stream(model, plan, shift(behaviour), options, "grpo", 0, pack_tokens=0, background=False)
    assert relative_error(grads(model), grads(reference)) > 1e-3


def test_a_clip_on_the_wrong_side_is_caught_by_the_dense_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """GSPO's clip binds in the stream: bounds swapped (low for high), or max for min, are caught."""
    plan = fixed_plan()
    options = {"loss": "gspo", "clip_low": 0.001, "clip_high": 0.2}
    model, reference = case(False, 0)
    behaviour, _ = behaviour_logprobs(model, plan, 0)
    loss, want = dense_loss(reference, plan, behaviour, options, "grpo")
    (-loss).backward()
    assert want is not None and 0 < want["is_clip_fraction"] < 1  # the case exercises the clip
    original = losses.gspo_term

    def swapped(lp, b, a, lo, hi):  # type: ignore[no-untyped-def]
        return original(lp, b, a, hi, lo)

    def maximum(lp, b, a, lo, hi):  # type: ignore[no-untyped-def]
        ratio = torch.exp((lp - b).mean()).reshape(1)
        value = torch.maximum(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a)
        return value, ratio, ratio > 0

    for planted in (swapped, maximum):
        for p in model.parameters():
            p.grad = None
        monkeypatch.setattr(losses, "gspo_term", planted)
        stream(model, plan, behaviour, options, "grpo", 0, pack_tokens=0, background=False)
        assert relative_error(grads(model), grads(reference)) > 1e-3, planted.__name__
    monkeypatch.setattr(losses, "gspo_term", original)
    for p in model.parameters():
        p.grad = None
    stream(model, plan, behaviour, options, "grpo", 0, pack_tokens=0, background=False)
    assert relative_error(grads(model), grads(reference)) < 1e-10


# an advantage of 0 or of magnitude 0.01..3: a subnormal one (hypothesis drew -5e-324) underflows
# every gradient to a few ulps of zero, where the planted error cannot show
ADVANTAGES = st.one_of(st.just(0.0), st.floats(0.01, 3), st.floats(-3, -0.01))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), advantage=ADVANTAGES, cap=st.sampled_from([None, 1.3]))
def test_decoupled_ppo_terms_with_a_moved_policy_equal_areal_form(
    seed: int, advantage: float, cap: float | None
) -> None:
    """With r != 1 (a proximal policy other than the current one) the clip binds; the terms'
    gradient equals AReaL's loss, and a clip on the wrong side (the optimistic arm) is caught."""
    gen = torch.Generator().manual_seed(seed)
    n = 16
    prox = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    lp = (prox + torch.randn(n, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
    b = prox + torch.randn(n, generator=gen, dtype=torch.float64) * 0.3
    lo, hi = 0.1, 0.25

    def areal(lp_: torch.Tensor, low: float, high: float, worst: bool = True) -> torch.Tensor:
        ratio = torch.exp(lp_ - prox)
        pg1, pg2 = -advantage * ratio, -advantage * torch.clamp(ratio, 1 - low, 1 + high)
        pg = torch.max(pg1, pg2) if worst else torch.min(pg1, pg2)
        behav = torch.exp(prox - b)
        mask = behav <= cap if cap is not None else torch.ones(n, dtype=torch.bool)
        return (pg * torch.where(mask, behav, 0.0)).sum()

    (want,) = torch.autograd.grad(areal(lp, lo, hi), lp)
    terms, _, clipped = losses.ppo_decoupled_terms(lp, prox, b, advantage, lo, hi, cap)
    (got,) = torch.autograd.grad(-terms.sum(), lp)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    binding = (torch.exp(lp - prox) * advantage).detach() > (torch.exp(lp - prox).clamp(1 - lo, 1 + hi) * advantage)
    masked = torch.exp(prox - b) > cap if cap is not None else torch.zeros(n, dtype=torch.bool)
    assert torch.equal(clipped, binding | masked)
    if advantage != 0 and bool((binding & ~masked).any()):  # a clip that binds on a kept token
        (wrong,) = torch.autograd.grad(areal(lp, lo, hi, worst=False), lp)  # planted: min for max
        assert not torch.allclose(wrong, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("lora", [False, True], ids=["separate-reference", "lora-base-reference"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(groups(), min_size=1, max_size=3),
    loss=st.sampled_from(["grpo", "tis", "ppo_decoupled", "gspo"]),
    kl=st.sampled_from([("k1", 0.3), ("k3", 0.05), ("k3", 1.0)]),
    seed=st.integers(0, 2**16),
    pack_tokens=st.sampled_from([0, 10_000]),
)
def test_kl_to_a_reference_streamed_equals_its_dense_definition_in_fp64(
    lora: bool, plan: list[Group], loss: str, kl: tuple[str, float], seed: int, pack_tokens: int
) -> None:
    """KL(pi || ref) by k1 or k3, the reference a separate model or (LoRA) the base model with the
    adapter disabled; groups whose rewards are all equal still contribute their KL."""
    model, reference = case(lora, seed)
    ref_model = None if lora else tiny_qwen3(torch.float64, seed=5)
    options = {"loss": loss, "kl_estimator": kl[0], "kl_coef": kl[1], "clip_low": 0.05, "clip_high": 0.05}
    behaviour, _ = behaviour_logprobs(model, plan, seed)
    dense, want = dense_loss(reference, plan, behaviour, options, "grpo", ref_model)
    if dense.requires_grad:
        (-dense).backward()
    got = stream(
        model, plan, behaviour, options, "grpo", seed, pack_tokens=pack_tokens, background=True, reference=ref_model
    )
    assert relative_error(grads(model), grads(reference)) < 1e-10
    if want is None:
        assert got is None
    else:
        assert got is not None and got.keys() >= want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key


def test_a_planted_kl_error_is_caught_by_the_dense_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """k3 with the log-ratio's sign flipped (KL(ref || pi)'s estimator), or the adapter left on
    (the learner as its own reference), moves the streamed gradient away from the dense one."""
    plan = fixed_plan()
    options = {"loss": "grpo", "kl_coef": 0.5, "kl_estimator": "k3"}
    model, reference = case(True, 0)
    behaviour, _ = behaviour_logprobs(model, plan, 0)
    dense, _ = dense_loss(reference, plan, behaviour, options, "grpo")
    (-dense).backward()
    original = losses.kl_terms

    def flipped(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
        return original(ref, lp, "k3")

    def adapter_on(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
        return original(lp, lp.detach(), "k3")

    for planted in (flipped, adapter_on, None):
        for p in model.parameters():
            p.grad = None
        monkeypatch.setattr(losses, "kl_terms", planted or original)
        stream(model, plan, behaviour, options, "grpo", 0, pack_tokens=0, background=False)
        error = relative_error(grads(model), grads(reference))
        assert error < 1e-10 if planted is None else error > 1e-3


def test_kl_without_an_adapter_or_a_reference_model_is_refused() -> None:
    run = thundersync.StreamingRun(tiny_qwen3(torch.float64))
    with pytest.raises(ConfigError, match="kl_coef > 0 needs a reference model"):
        thundersync.RewardLinearBackward(run, kl_coef=0.1)


def test_the_loss_forms_need_behaviour_logprobs() -> None:
    run = thundersync.StreamingRun(tiny_qwen3(torch.float64))
    grpo = thundersync.RewardLinearBackward(run, loss="tis")
    grpo.open_group("g", [1, 2])
    with pytest.raises(ConfigError, match="loss='tis' weights every scored token by its behaviour log-prob"):
        grpo.append_turn("g", 0, [3, 4], [True, True])
    grpo.append_turn("g", 0, [3, 4], [False, False])  # an observation needs none


def test_grpo_reports_no_objective_stats() -> None:
    run = thundersync.StreamingRun(tiny_qwen3(torch.float64))
    grpo = thundersync.RewardLinearBackward(run)
    grpo.open_group("g", [1, 2])
    grpo.append_turn("g", 0, [3, 4], [True, True], behaviour_logprobs=[-1.0, -2.0])
    grpo.close_trajectory("g", 0, 1.0)
    grpo.append_turn("g", 1, [3, 5], [True, True], behaviour_logprobs=[-1.0, -2.0])
    grpo.close_trajectory("g", 1, 0.0)
    grpo.close_group("g")
    grpo.assert_safe_to_step()
    assert grpo.take_objective_stats() is None


def test_the_lora_reference_is_scored_holding_the_models_adapter_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """peft's disable_adapter switches the adapter off for the whole module: the reference call holds
    the model's adapter lock (a torch-generator over the same module steps only under it)."""
    model, _ = case(True, 0)
    run = thundersync.StreamingRun(model)
    seen: list[tuple[bool, bool]] = []

    def logprobs(self: Any, sequences: Any, counts: Any) -> list[list[float]]:
        layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
        seen.append((adapter_lock(model).locked(), bool(layer.disable_adapters)))
        return [[0.0] * count for count in counts]

    monkeypatch.setattr(PackedScorer, "logprobs", logprobs)
    score = reference_scorer(run, None)
    assert score([[1, 2, 3]], [2]) == [[0.0, 0.0]]
    assert seen == [(True, True)]
    assert not adapter_lock(model).locked()


@pytest.mark.parametrize("pack_tokens", [0, 10_000])
def test_a_group_whose_rewards_turn_out_equal_counts_no_importance_weight(pack_tokens: int) -> None:
    """tis streams a branch before its group closes (pack_tokens = 0): a group found all-equal at
    its close contributes nothing, and its early branches' weights leave the statistics too."""
    from tests.grpo.grpo_cases import Trajectory, Turn

    plan = [Group(prompt=[0], trajectories=[Trajectory(turns=[Turn(tokens=[0], scored=[True])], reward=0.0)])]
    model, reference = case(False, 0)
    options = {"loss": "tis", "tis_cap": 1.05}
    behaviour, _ = behaviour_logprobs(model, plan, 0)
    _, want = dense_loss(reference, plan, behaviour, options, "grpo")
    got = stream(model, plan, behaviour, options, "grpo", 0, pack_tokens=pack_tokens, background=False)
    assert want is None and got is None
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
