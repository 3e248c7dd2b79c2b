"""OPD test cases: tiny Qwen3 students, batch plans, interleavings and the independent dense reference."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from tests.engine import tiny_models

VOCAB = 97  # tests.engine.tiny_models' vocabulary


def tiny_qwen3(dtype: torch.dtype, *, lora: bool = False) -> torch.nn.Module:
    """The engine tests' tiny random Qwen3 (untied head, fp64-native norms), optionally LoRA."""
    model = tiny_models.tiny_qwen3(dtype)
    return tiny_models.with_lora(model) if lora else model


@dataclass
class Turn:
    tokens: list[int]
    scored: list[bool]
    teacher: list[float]  # one per scored token
    behaviour: list[float] | None  # one per scored token, or None


@dataclass
class Trajectory:
    turns: list[Turn]


@dataclass
class Group:
    prompt: list[int]
    trajectories: dict[str, Trajectory] = field(default_factory=dict)


Plan = dict[str, Group]


@st.composite
def turns(draw: st.DrawFn, *, action: bool, with_behaviour: bool) -> Turn:
    length = draw(st.integers(1, 5))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
    scored = draw(st.lists(st.booleans(), min_size=length, max_size=length)) if action else [False] * length
    count = sum(scored)
    logprob = st.floats(-6.0, -0.01)
    teacher = draw(st.lists(logprob, min_size=count, max_size=count))
    behaviour = draw(st.lists(logprob, min_size=count, max_size=count)) if with_behaviour else None
    return Turn(tokens, scored, teacher, behaviour)


@st.composite
def plans(draw: st.DrawFn, *, with_behaviour: bool, max_groups: int = 2) -> Plan:
    plan: Plan = {}
    for g in range(draw(st.integers(1, max_groups))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
        group = Group(prompt)
        for i in range(draw(st.integers(1, 3))):
            kinds = draw(st.lists(st.booleans(), min_size=1, max_size=4))  # True: action turn
            group.trajectories[f"t{i}"] = Trajectory(
                [draw(turns(action=kind, with_behaviour=with_behaviour)) for kind in kinds]
            )
        plan[f"g{g}"] = group
    return plan


Op = tuple[str, str, str | None, int | None]  # (kind, group, trajectory, turn index)


def interleaving(plan: Plan, rng: random.Random) -> list[Op]:
    """A random order of opens, appends and closes that respects each object's own order."""
    queues: list[list[Op]] = []
    for gid, group in plan.items():
        per_traj = [
            [("append", gid, tid, k) for k in range(len(traj.turns))] + [("close_trajectory", gid, tid, None)]
            for tid, traj in group.trajectories.items()
        ]
        merged = _merge(per_traj, rng)
        queues.append([("open_group", gid, None, None), *merged, ("close_group", gid, None, None)])
    return _merge(queues, rng)


def _merge(queues: list[list[Op]], rng: random.Random) -> list[Op]:
    pending = [list(q) for q in queues if q]
    out: list[Op] = []
    while pending:
        queue = rng.choice(pending)
        out.append(queue.pop(0))
        if not queue:
            pending.remove(queue)
    return out


def dense_reference_grads(
    model: torch.nn.Module, plan: Plan, normalization: str, advantage: str = "behaviour"
) -> dict[str, torch.Tensor]:
    """Full sequences through the model's ordinary forward, the loss formed directly, backward()
    (``advantage="learner"``: each token's reward from its learner log-prob, not its behaviour one)."""
    model.zero_grad(set_to_none=True)
    terms: list[torch.Tensor] = []
    for group in plan.values():
        for traj in group.trajectories.values():
            ids = list(group.prompt)
            targets: list[int] = []  # positions (in ids) of scored tokens
            teacher: list[float] = []
            behaviour: list[float | None] = []
            for turn in traj.turns:
                scored_iter = iter(range(len(turn.teacher)))
                for token, scored in zip(turn.tokens, turn.scored):
                    if scored:
                        j = next(scored_iter)
                        targets.append(len(ids))
                        teacher.append(turn.teacher[j])
                        behaviour.append(None if turn.behaviour is None else turn.behaviour[j])
                    ids.append(token)
            if not targets:
                continue
            device = next(model.parameters()).device
            logits = model(torch.tensor([ids], device=device)).logits[0]
            logp = torch.log_softmax(logits, -1)
            pos = torch.tensor(targets, device=device)
            lp = logp[pos - 1, torch.tensor(ids, device=device)[pos]]
            for k in range(len(targets)):
                b = (
                    lp[k].detach()
                    if behaviour[k] is None
                    else torch.tensor(behaviour[k], dtype=lp.dtype, device=device)
                )
                q = torch.tensor(teacher[k], dtype=lp.dtype, device=device)
                own = lp[k].detach() if advantage == "learner" else b
                terms.append(torch.exp(lp[k] - b) * (own - q).detach())
    count = len(terms)
    if terms:
        loss = torch.stack(terms).sum()
        if normalization == "token_mean":
            loss = loss / count
        loss.backward()
    grads = {
        name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return grads


def fp64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in fp64 (norms computed in fp64 too): an exact-enough reference for fp32."""
    double = copy.deepcopy(model).to(torch.float64)
    tiny_models.use_native_norms(double)
    return double


def advantage_condition(model: torch.nn.Module, plan: Plan) -> float:
    """max over on-policy scored tokens of |lp_t| / |lp_t - q_t| (``model``'s log-probs).

    On policy the gradient is ``sum_t (lp_t - q_t) grad lp_t``, linear in the advantage
    ``lp_t - q_t``, and an fp32 forward knows lp_t only to a few units of roundoff relative to
    |lp_t|. When a teacher score lands near the student's own log-prob, that roundoff is
    magnified by this ratio in the advantage, in any fp32 computation (the streamed one and a
    dense fp32 one alike). Turns with behaviour log-probs have constant advantages and are skipped.
    """
    worst = 1.0
    device = next(model.parameters()).device
    with torch.no_grad():
        for group in plan.values():
            for traj in group.trajectories.values():
                ids, positions, teacher = list(group.prompt), [], []
                for turn in traj.turns:
                    scores = iter(turn.teacher)
                    for token, scored in zip(turn.tokens, turn.scored):
                        if scored and turn.behaviour is None:
                            positions.append(len(ids))
                            teacher.append(next(scores))
                        elif scored:
                            next(scores)
                        ids.append(token)
                if not positions:
                    continue
                logp = torch.log_softmax(model(torch.tensor([ids], device=device)).logits[0], -1)
                for position, q in zip(positions, teacher):
                    lp = float(logp[position - 1, ids[position]])
                    worst = max(worst, abs(lp) / max(abs(lp - q), 1e-300))
    return worst


def collect_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(float(((got[k].double() - want[k].double()) ** 2).sum()) for k in want)
    den = sum(float((want[k].double() ** 2).sum()) for k in want)
    return (num / den) ** 0.5 if den > 0 else num**0.5


def drive(opd: object, plan: Plan, ops: list[Op]) -> Iterator[Op]:
    """Apply ops to an OPDStream, yielding each op after it ran."""
    for kind, gid, tid, k in ops:
        group = plan[gid]
        if kind == "open_group":
            opd.open_group(gid, group.prompt)
        elif kind == "append":
            turn = group.trajectories[tid].turns[k]
            opd.append_turn(
                gid,
                tid,
                turn.tokens,
                turn.scored,
                teacher_logprobs=turn.teacher if any(turn.scored) else None,
                behaviour_logprobs=turn.behaviour if any(turn.scored) else None,
            )
        elif kind == "close_trajectory":
            opd.close_trajectory(gid, tid)
        else:
            opd.close_group(gid)
        yield kind, gid, tid, k
