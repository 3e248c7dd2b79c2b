"""A real ``max_staleness = 2`` run on CPU (fp64): its batches hold trajectories sampled under
several policy versions, each action's behaviour log-probs are those of the version that sampled
it, and each streamed step under ``loss = "tis"`` equals the dense definition of
:mod:`tests.grpo.test_losses` at the learner's version with those behaviour log-probs (1e-10).
Planted error: the dense reference fed a wrong version's log-probs is caught. (The constructed
case, several versions per batch drawn at random, is tests/grpo/test_losses.py's.)

The generator makes trajectory 1 of each group of batch ``n`` wait for version ``n`` before it
samples (trajectory 0 samples at once, up to two versions earlier), so every batch from the
second on mixes versions.
"""

from __future__ import annotations

import copy
from typing import Any

import anyio
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3, use_native_norms
from tests.grpo.grpo_cases import Group, Trajectory, Turn, relative_error
from tests.grpo.test_losses import dense_loss, scored_logprobs
from thundersync.events import ActionGenerated, EventBase, GroupOpened, PromptSubmitted, Rewarded
from thundersync.generation import GenerationRequest, GenerationResult, TorchGenerator
from thundersync.pipeline import Graph, Pipeline
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.step import StepStage, StreamingTrainer
from thundersync.testing import FakeScorer

OPTIONS = {"loss": "tis", "tis_cap": 2.0}
BATCHES, GROUPS, SAMPLES = 4, 2, 2


class _Waits:
    """A torch-generator whose trajectory 1 of batch ``n`` samples only once version ``n`` is live."""

    def __init__(self, inner: TorchGenerator, clock: PolicyClock) -> None:
        self.inner, self.clock = inner, clock

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if str(request.session_id).endswith("/1"):
            await self.clock.wait_for(request.prompt_ids[1] - 20)
        return await self.inner.generate(request)

    def allow_weight_changes(self) -> None:
        self.inner.allow_weight_changes()


class _Recording(torch.optim.SGD):
    """SGD that keeps the gradient of each step (the streamed one) before it moves the weights."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, lr=0.02, maximize=True)
        self.grads: list[list[torch.Tensor | None]] = []

    def step(self, closure: Any = None) -> Any:
        self.grads.append(
            [None if p.grad is None else p.grad.clone() for group in self.param_groups for p in group["params"]]
        )
        return super().step(closure)


class _Snapshots:
    """A checkpointer that keeps the weights of every version in memory."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights = {0: copy.deepcopy(model.state_dict())}

    async def stepped(self, step: int, batch_id: Any) -> None:
        self.weights[step] = copy.deepcopy(self.model.state_dict())

    async def finished(self, step: int) -> None: ...

    def at(self, version: int, *, as_generator: bool = False) -> torch.nn.Module:
        """The model at ``version``; ``as_generator``: with fp64 norms and softmax, as the generator's."""
        model = copy.deepcopy(self.model)
        model.load_state_dict(self.weights[version])
        if as_generator:
            model.config._attn_implementation = "sdpa"
            use_native_norms(model)
        return model


def _run(model: torch.nn.Module) -> tuple[list[EventBase], _Recording, _Snapshots]:
    clock = PolicyClock(max_staleness=2)
    objective = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), pack_tokens=16, **OPTIONS)
    optimizer, snapshots = _Recording(objective.run.params), _Snapshots(model)
    events: list[EventBase] = []
    graph = (
        Graph()
        .add(
            "generate",
            GenerateStage(
                GenerateStage.Config(max_new_tokens=5),
                generator=_Waits(TorchGenerator(model, max_batch=16, max_seq_len=32), clock),
                policy=clock,
            ),
            reads=["input"],
            output=True,
        )
        .add("reward", RewardStage(scorer=FakeScorer()), reads=["generate"], output=True)
        .add("backward", BackwardStage(objective=objective, policy=clock), reads=["generate", "reward"])
        .add(
            "close",
            CloseStage(CloseStage.Config(wait_for=("reward", "backward"))),
            reads=["generate", "reward", "backward"],
        )
        .add(
            "step",
            StepStage(trainer=StreamingTrainer(objective, optimizer), policy=clock, checkpointer=snapshots),
            reads=["close"],
        )
    )
    prompts = [
        PromptSubmitted(
            group_id=f"{b}.{g}",
            prompt_tokens=[10 + g, 20 + b, 30],
            num_trajectories=SAMPLES,
            batch_id=b,
            groups_in_batch=GROUPS,
        )
        for b in range(BATCHES)
        for g in range(GROUPS)
    ]

    async def main() -> None:
        with anyio.fail_after(300):
            async with Pipeline(graph) as pipeline:
                for prompt in prompts:
                    await pipeline.send(prompt)
                await pipeline.close()
                events.extend([event async for event in pipeline.results()])

    anyio.run(main)
    return events, optimizer, snapshots


def _batch(events: list[EventBase], batch: int) -> tuple[list[Group], list[list[ActionGenerated]]]:
    plan, actions = [], []
    for opened in (e for e in events if isinstance(e, GroupOpened) and e.batch_id == batch):
        mine = [e for e in events if isinstance(e, ActionGenerated | Rewarded) and e.group_id == opened.group_id]
        acts = [
            next(e for e in mine if isinstance(e, ActionGenerated) and e.trajectory_id == t)
            for t in opened.trajectory_ids
        ]
        rewards = [
            next(e.reward for e in mine if isinstance(e, Rewarded) and e.trajectory_id == t)
            for t in opened.trajectory_ids
        ]
        turns = [[Turn(list(a.token_ids), [True] * len(a.token_ids))] for a in acts]
        plan.append(Group(list(opened.prompt_tokens), [Trajectory(t, r) for t, r in zip(turns, rewards, strict=True)]))
        actions.append(acts)
    return plan, actions


def _sequence(group: Group, action: ActionGenerated) -> tuple[list[int], list[bool]]:
    return group.prompt + list(action.token_ids), [False] * len(group.prompt) + [True] * len(action.token_ids)


def _logprobs(model: torch.nn.Module, group: Group, action: ActionGenerated) -> torch.Tensor:
    with torch.no_grad():
        return scored_logprobs(model, *_sequence(group, action))


def _sampled_on(action: ActionGenerated) -> int | None:
    """The version every token of ``action`` came from, when one did (a waiting request: the end's)."""
    if action.trajectory_id == 1:
        return action.ended_policy_version if action.ended_policy_version is not None else action.policy_version
    return action.policy_version if action.ended_policy_version is None else None


def test_a_k2_runs_batches_mix_versions_and_each_step_is_the_dense_tis_gradient() -> None:
    model = tiny_qwen3(torch.float64)
    events, optimizer, snapshots = _run(model)
    assert len(optimizer.grads) == BATCHES
    mixed = 0
    for batch in range(BATCHES):
        plan, actions = _batch(events, batch)
        versions = {_sampled_on(a) for group in actions for a in group}
        mixed += len(versions - {None}) > 1
        behaviour = [[torch.tensor(a.behaviour_logprobs, dtype=torch.float64) for a in group] for group in actions]
        for group, acts in zip(plan, actions, strict=True):  # each token's log-prob is its sampling version's
            for action in acts:
                version = _sampled_on(action)
                if version is not None:
                    want = _logprobs(snapshots.at(version, as_generator=True), group, action)
                    assert (
                        float((torch.tensor(action.behaviour_logprobs, dtype=torch.float64) - want).abs().max()) < 1e-10
                    )
        learner = snapshots.at(batch)  # batch n is stepped on version n
        loss, _ = dense_loss(learner, plan, behaviour, OPTIONS, "grpo")
        learner.zero_grad(set_to_none=True)
        (-loss).backward()
        want = [p.grad for p in learner.parameters()]
        assert relative_error(optimizer.grads[batch], want) < 1e-10, batch
        if batch >= 1:  # planted: trajectory 1's log-probs from the version before the one that sampled it
            older = snapshots.at(batch - 1, as_generator=True)
            wrong = [
                [b if i == 0 else _logprobs(older, g, a) for i, (b, a) in enumerate(zip(bs, acts))]
                for g, bs, acts in zip(plan, behaviour, actions, strict=True)
            ]
            bad_model = snapshots.at(batch)
            bad, _ = dense_loss(bad_model, plan, wrong, OPTIONS, "grpo")
            (-bad).backward()
            assert relative_error(optimizer.grads[batch], [p.grad for p in bad_model.parameters()]) > 1e-6, batch
    assert mixed >= 1  # at least one batch held trajectories of several versions
