"""GRPO test cases: random batch plans, random interleavings, and the independent dense reference."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

VOCAB = 97


@dataclass
class Turn:
    tokens: list[int]
    scored: list[bool]


@dataclass
class Trajectory:
    turns: list[Turn]
    reward: float


@dataclass
class Group:
    prompt: list[int]
    trajectories: list[Trajectory]


@st.composite
def turns(draw: st.DrawFn) -> Turn:
    n = draw(st.integers(0, 7))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    if draw(st.booleans()):  # an observation turn: context only
        return Turn(tokens, [False] * n)
    return Turn(tokens, draw(st.lists(st.booleans(), min_size=n, max_size=n)))


@st.composite
def groups(draw: st.DrawFn) -> Group:
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9))
    size = draw(st.integers(1, 8))
    rewards = st.sampled_from([0.0, 1.0, 0.5, -2.0]) | st.floats(-3, 3, allow_nan=False)
    trajectories = [Trajectory(draw(st.lists(turns(), min_size=1, max_size=5)), draw(rewards)) for _ in range(size)]
    return Group(prompt, trajectories)


def interleaving(plan: list[Group], rng: random.Random) -> Iterator[tuple]:
    """A random order of (op, ...) calls that respects each group's and trajectory's own order."""
    queues: list[list[tuple]] = []
    closers: dict[int, int] = {}  # group -> trajectories still open
    for g, group in enumerate(plan):
        queues.append([("open", g)])
        closers[g] = len(group.trajectories)
        for i, traj in enumerate(group.trajectories):
            queues.append([("append", g, i, t) for t in range(len(traj.turns))] + [("close", g, i)])
    opened: set[int] = set()
    while queues:
        ready = [q for q in queues if q[0][0] == "open" or q[0][1] in opened]
        queue = rng.choice(ready)
        op = queue.pop(0)
        if op[0] == "open":
            opened.add(op[1])
        if not queue:
            queues.remove(queue)
        yield op
        if op[0] == "close":
            closers[op[1]] -= 1
            if closers[op[1]] == 0:
                yield ("close_group", op[1])


def advantages(rewards: list[float], estimator: str, eps: float) -> list[float]:
    """Written from the issue's definitions, independently of thundersync.grpo.estimators."""
    n = len(rewards)
    mean = sum(rewards) / n
    if estimator == "grpo":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
        return [(r - mean) / (std + eps) for r in rewards]
    if estimator == "dr_grpo":
        return [r - mean for r in rewards]
    if n == 1:
        return [0.0]
    return [r - (sum(rewards) - r) / (n - 1) for r in rewards]


def dense_objective(model: torch.nn.Module, plan: list[Group], estimator: str, eps: float) -> torch.Tensor:
    """J = sum_g sum_i A_i sum_scored log pi, each trajectory through the model's ordinary forward."""
    terms = []
    for group in plan:
        weights = advantages([t.reward for t in group.trajectories], estimator, eps)
        for traj, weight in zip(group.trajectories, weights):
            tokens = list(group.prompt)
            scored = [False] * len(tokens)
            for turn in traj.turns:
                tokens += turn.tokens
                scored += turn.scored
            ids = torch.tensor(tokens)
            logits = model(input_ids=ids[None]).logits[0]
            logp = torch.log_softmax(logits.double() if logits.dtype == torch.float64 else logits.float(), -1)
            lp = logp[:-1].gather(-1, ids[1:, None])[:, 0]
            mask = torch.tensor(scored[1:], dtype=torch.bool)
            terms.append(weight * lp[mask].sum())
    return torch.stack(terms).sum()


def grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


def relative_error(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> float:
    diff = sum(
        float(((g if g is not None else 0) - (w if w is not None else 0)).double().pow(2).sum())
        for g, w in zip(got, want)
        if g is not None or w is not None
    )
    norm = sum(float(w.double().pow(2).sum()) for w in want if w is not None)
    return math.sqrt(diff) / math.sqrt(norm) if norm > 0 else math.sqrt(diff)
