"""The backward stage: events in any order that the edges allow give the dense full-batch gradient.

Each case draws a batch shaped like a pipeline's (trajectories of actions with observations between
them, ending with a final action), sends its events to the stage in a random order that keeps
each trajectory's turns in order but lets rewards and teacher scores arrive early or late, and
compares the gradient after ``assert_safe_to_step`` with the ordinary forward + ``backward()`` of
the same batch (fp64, 1e-10). Whole graphs (generate, tools, reward or teacher, backward, close,
step) are checked the same way.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thundersync
from tests.engine.tiny_models import tiny_qwen3
from tests.grpo import grpo_cases
from tests.opd import opd_cases
from thundersync.errors import ConfigError, StageFailed
from thundersync.events import (
    ActionGenerated,
    BackwardDone,
    EventBase,
    GroupOpened,
    PromptSubmitted,
    Rewarded,
    StepDone,
    TeacherScored,
    ToolObserved,
)
from thundersync.pipeline import Graph, Pipeline, Stage
from thundersync.pipeline.policy import PolicyClock
from thundersync.pipeline.stage import Inbox, Outbox
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.step import StepStage, StreamingTrainer
from thundersync.stages.teacher import TeacherStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import FakeScorer, FakeTeacher, ScriptedGenerator, ScriptedTool

VOCAB = grpo_cases.VOCAB
RunStage = Callable[[Stage, Sequence[EventBase]], Any]
CASES = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _kinds(draw: st.DrawFn) -> list[bool]:
    """Action (True) and observation turns, alternating, starting and ending with an action."""
    actions = draw(st.integers(1, 3))
    return [k % 2 == 0 for k in range(2 * actions - 1)]


@st.composite
def grpo_plans(draw: st.DrawFn) -> list[grpo_cases.Group]:
    plan = []
    for _ in range(draw(st.integers(1, 2))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
        trajectories = []
        for _ in range(draw(st.integers(1, 4))):
            turns = []
            for action in _kinds(draw):
                n = draw(st.integers(1, 5))
                tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
                scored = draw(st.lists(st.booleans(), min_size=n, max_size=n)) if action else [False] * n
                turns.append(grpo_cases.Turn(tokens, scored))
            trajectories.append(grpo_cases.Trajectory(turns, draw(st.sampled_from([0.0, 1.0, -0.5, 2.0]))))
        plan.append(grpo_cases.Group(prompt, trajectories))
    return plan


@st.composite
def opd_plans(draw: st.DrawFn) -> opd_cases.Plan:
    plan: opd_cases.Plan = {}
    for g in range(draw(st.integers(1, 2))):
        group = opd_cases.Group(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)))
        for i in range(draw(st.integers(1, 3))):
            turns = [draw(opd_cases.turns(action=a, with_behaviour=draw(st.booleans()))) for a in _kinds(draw)]
            group.trajectories[f"t{i}"] = opd_cases.Trajectory(turns)
        plan[f"g{g}"] = group
    return plan


def _turn_events(
    group: Any, trajectory: Any, turns: list[Any], early: Callable[[int, Any], EventBase | None]
) -> tuple[list[EventBase], list[EventBase]]:
    """(turn events in order, events of other edges), with action ``k``'s extra event from ``early``."""
    ordered: list[EventBase] = []
    others: list[EventBase] = []
    for k, turn in enumerate(turns):
        if k % 2:
            ordered.append(ToolObserved(group_id=group, trajectory_id=trajectory, turn=k, token_ids=turn.tokens))
            continue
        behaviour = getattr(turn, "behaviour", None)
        per_token = iter(behaviour or [])
        ordered.append(
            ActionGenerated(
                group_id=group,
                trajectory_id=trajectory,
                turn=k,
                token_ids=turn.tokens,
                scored=turn.scored,
                behaviour_logprobs=[next(per_token) if s else -9.0 for s in turn.scored] if behaviour else [],
                final=k == len(turns) - 1,
            )
        )
        extra = early(k, turn)
        if extra is not None:
            others.append(extra)
    return ordered, others


def _shuffle(
    opened: list[EventBase], queues: list[list[EventBase]], loose: list[EventBase], rng: random.Random
) -> list[EventBase]:
    """Group openings first; each queue keeps its order; loose events land anywhere after them."""
    events = list(opened)
    merged: list[EventBase] = []
    pending = [list(q) for q in queues if q]
    while pending:
        queue = rng.choice(pending)
        merged.append(queue.pop(0))
        if not queue:
            pending.remove(queue)
    for event in loose:
        merged.insert(rng.randrange(len(merged) + 1), event)
    return events + merged


def _check_done(out: list[EventBase], expected_turns: set[tuple[Any, Any, int]], groups: set[Any]) -> None:
    assert all(isinstance(e, BackwardDone) for e in out)
    turns = [(e.group_id, e.trajectory_id, e.turn) for e in out if e.trajectory_id is not None]
    assert sorted(map(repr, turns)) == sorted(map(repr, expected_turns))  # each action turn once
    prompt_at = {e.group_id: i for i, e in enumerate(out) if e.trajectory_id is None}
    assert set(prompt_at) == groups
    for i, e in enumerate(out):  # a group's prompt comes after all of its turns
        if e.trajectory_id is not None:
            assert i < prompt_at[e.group_id]


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@CASES
@given(plan=grpo_plans(), seed=st.integers(0, 2**16))
def test_grpo_events_in_any_edge_order_give_the_dense_gradient(
    run_stage: RunStage, estimator: str, plan: list[grpo_cases.Group], seed: int
) -> None:
    model = tiny_qwen3(torch.float64)
    grpo = thundersync.RewardLinearBackward(
        thundersync.StreamingRun(model), estimator=estimator, pack_tokens=int(seed % 3) * 8
    )
    rng = random.Random(seed)
    opened, queues, loose, turns = [], [], [], set()
    for g, group in enumerate(plan):
        ids = list(range(len(group.trajectories)))
        opened.append(GroupOpened(group_id=g, prompt_tokens=group.prompt, trajectory_ids=ids))
        for i, traj in enumerate(group.trajectories):
            ordered, _ = _turn_events(g, i, traj.turns, lambda k, turn: None)
            queues.append(ordered)
            loose.append(Rewarded(group_id=g, trajectory_id=i, reward=traj.reward))  # before or after the final action
            turns.update((g, i, k) for k in range(0, len(traj.turns), 2))
    out = anyio.run(run_stage, BackwardStage(objective=grpo), _shuffle(opened, queues, loose, rng))
    _check_done(out, turns, set(range(len(plan))))
    grpo.assert_safe_to_step()
    got = grpo_cases.grads(model)
    model.zero_grad(set_to_none=True)
    grpo_cases.dense_objective(model, plan, estimator, 1e-6).backward()
    assert grpo_cases.relative_error(got, grpo_cases.grads(model)) < 1e-10


@CASES
@given(plan=opd_plans(), seed=st.integers(0, 2**16))
def test_opd_actions_wait_for_their_teacher_scores_and_give_the_dense_gradient(
    run_stage: RunStage, plan: opd_cases.Plan, seed: int
) -> None:
    model = tiny_qwen3(torch.float64)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model), normalization="token_mean")
    rng = random.Random(seed)
    opened, queues, loose, turns = [], [], [], set()
    for g, group in plan.items():
        opened.append(GroupOpened(group_id=g, prompt_tokens=group.prompt, trajectory_ids=list(group.trajectories)))
        for t, traj in group.trajectories.items():
            ordered, scores = _turn_events(
                g,
                t,
                traj.turns,
                lambda k, turn, g=g, t=t: TeacherScored(
                    group_id=g, trajectory_id=t, turn=k, teacher_logprobs=turn.teacher
                ),
            )
            queues.append(ordered)
            loose += scores  # teacher scores may come before their action
            turns.update((g, t, k) for k in range(0, len(traj.turns), 2))
    out = anyio.run(run_stage, BackwardStage(objective=opd), _shuffle(opened, queues, loose, rng))
    _check_done(out, turns, set(plan))
    opd.assert_safe_to_step()
    got = opd_cases.collect_grads(model)
    assert opd_cases.relative_error(got, opd_cases.dense_reference_grads(model, plan, "token_mean")) < 1e-10


class _Recorder(Stage):
    """Keeps what generate, reward and teacher send: the batch for the dense reference."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = (
        GroupOpened,
        ActionGenerated,
        ToolObserved,
        Rewarded,
        TeacherScored,
    )
    produces: ClassVar[tuple[type[EventBase], ...]] = ()

    def __init__(self) -> None:
        super().__init__()
        self.events: list[EventBase] = []

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async for event in inbox:
            self.events.append(event)


class _GradientsOnly:
    """An optimizer that keeps each step's gradients and leaves the parameters alone."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.steps: list[list[torch.Tensor | None]] = []

    def step(self) -> None:
        self.steps.append([None if p.grad is None else p.grad.clone() for p in self.params])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _run_graph(objective: Any, scores: tuple[str, Stage]) -> tuple[_Recorder, _GradientsOnly]:
    """generate (3 turns, a tool) -> reward or teacher -> backward -> close -> step, two batches of two groups."""
    optimizer = _GradientsOnly(objective.run.params)
    policy, recorder = PolicyClock(), _Recorder()
    name, stage = scores
    graph = (
        Graph()
        .add(
            "generate",
            GenerateStage(
                GenerateStage.Config(turns=3, max_new_tokens=6),
                generator=ScriptedGenerator(vocab_size=VOCAB),
                tool_calls=ScriptedTool(end_token=5),
                policy=policy,
            ),
            reads=["input"],
            feedback=["tool"],
        )
        .add("tool", ToolExecuteStage(tools=ScriptedTool(vocab_size=VOCAB)), reads=["generate"])
        .add(name, stage, reads=["generate", "tool"])
        .add("record", recorder, reads=["generate", "tool", name])
        .add("backward", BackwardStage(objective=objective), reads=["generate", "tool", name])
        .add(
            "close",
            CloseStage(CloseStage.Config(wait_for=(name, "backward"))),  # type: ignore[arg-type]
            reads=["generate", name, "backward"],
        )
        .add(
            "step",
            StepStage(trainer=StreamingTrainer(objective, optimizer), policy=policy),
            reads=["close"],
            output=True,
        )
    )
    prompts = [
        PromptSubmitted(
            group_id=f"{b}.{g}", prompt_tokens=[10 + g, 20 + b, 30], num_trajectories=3, batch_id=b, groups_in_batch=2
        )
        for b in range(2)
        for g in range(2)
    ]

    async def main() -> list[EventBase]:
        async with Pipeline(graph) as pipeline:
            for prompt in prompts:
                await pipeline.send(prompt)
            await pipeline.close()
            return [event async for event in pipeline.results()]

    out = anyio.run(main)
    assert [e.policy_version for e in out if isinstance(e, StepDone)] == [1, 2]
    assert len(optimizer.steps) == 2
    return recorder, optimizer


def _batches(events: list[EventBase]) -> dict[Any, dict[Any, tuple[GroupOpened, dict[Any, list[EventBase]]]]]:
    """batch -> group -> (its GroupOpened, trajectory -> its events in arrival order)."""
    batches: dict[Any, dict[Any, tuple[GroupOpened, dict[Any, list[EventBase]]]]] = {}
    where: dict[Any, dict[Any, list[EventBase]]] = {}
    for e in events:
        if isinstance(e, GroupOpened):
            where[e.group_id] = {t: [] for t in e.trajectory_ids}
            batches.setdefault(e.batch_id, {})[e.group_id] = (e, where[e.group_id])
        else:
            where[e.group_id][e.trajectory_id].append(e)  # type: ignore[attr-defined]
    return batches


def test_a_whole_grpo_graph_steps_on_the_dense_gradient_of_each_batch() -> None:
    model = tiny_qwen3(torch.float64)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), pack_tokens=16)
    recorder, optimizer = _run_graph(grpo, ("reward", RewardStage(scorer=FakeScorer())))
    for (_, groups), got in zip(sorted(_batches(recorder.events).items()), optimizer.steps, strict=True):
        plan = []
        for opened, trajectories in groups.values():
            group = grpo_cases.Group(list(opened.prompt_tokens), [])
            for events in trajectories.values():
                turns = [
                    grpo_cases.Turn(
                        list(e.token_ids),
                        (e.scored or [True] * len(e.token_ids))
                        if isinstance(e, ActionGenerated)
                        else [False] * len(e.token_ids),
                    )
                    for e in events
                    if isinstance(e, ActionGenerated | ToolObserved)
                ]
                reward = next(e.reward for e in events if isinstance(e, Rewarded))
                group.trajectories.append(grpo_cases.Trajectory(turns, reward))
            plan.append(group)
        model.zero_grad(set_to_none=True)
        grpo_cases.dense_objective(model, plan, "grpo", 1e-6).backward()
        assert grpo_cases.relative_error(got, grpo_cases.grads(model)) < 1e-10


def test_a_whole_opd_graph_steps_on_the_dense_gradient_of_each_batch() -> None:
    model = tiny_qwen3(torch.float64)
    opd = thundersync.OPDStream(thundersync.StreamingRun(model), pack_tokens=16)
    recorder, optimizer = _run_graph(opd, ("teacher", TeacherStage(teacher=FakeTeacher())))
    for (_, groups), got in zip(sorted(_batches(recorder.events).items()), optimizer.steps, strict=True):
        plan: opd_cases.Plan = {}
        for gid, (opened, trajectories) in groups.items():
            group = plan[gid] = opd_cases.Group(list(opened.prompt_tokens))
            for tid, events in trajectories.items():
                teacher = {e.turn: e.teacher_logprobs for e in events if isinstance(e, TeacherScored)}
                turns = []
                for e in events:
                    if isinstance(e, ToolObserved):
                        turns.append(opd_cases.Turn(list(e.token_ids), [False] * len(e.token_ids), [], None))
                    elif isinstance(e, ActionGenerated):  # ScriptedGenerator scores every token
                        turns.append(
                            opd_cases.Turn(
                                list(e.token_ids),
                                [True] * len(e.token_ids),
                                teacher[e.turn],
                                list(e.behaviour_logprobs),
                            )
                        )
                group.trajectories[tid] = opd_cases.Trajectory(turns)
        want = opd_cases.dense_reference_grads(model, plan, "token_mean")
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        assert opd_cases.relative_error(dict(zip(names, got, strict=True)), want) < 1e-10  # type: ignore[arg-type]


def test_a_run_that_failed_mid_batch_is_discarded_when_the_graph_runs_again(run_stage: RunStage) -> None:
    model = tiny_qwen3(torch.float64)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model))
    stage = BackwardStage(objective=grpo)
    plan = [
        grpo_cases.Group(
            [3, 4], [grpo_cases.Trajectory([grpo_cases.Turn([5, 6, 7], [True, False, True])], r) for r in (0.0, 1.0)]
        )
    ]
    opened = GroupOpened(group_id="g", prompt_tokens=[3, 4], trajectory_ids=[0, 1])
    actions = [
        ActionGenerated(
            group_id="g", trajectory_id=i, turn=0, token_ids=[5, 6, 7], scored=[True, False, True], final=True
        )
        for i in (0, 1)
    ]
    rewards = [Rewarded(group_id="g", trajectory_id=i, reward=r) for i, r in ((0, 0.0), (1, 1.0))]
    with pytest.raises(StageFailed, match="groups 'g' are still open"):  # the second reward never came
        anyio.run(run_stage, stage, [opened, *actions, rewards[0]])
    out = anyio.run(run_stage, stage, [opened, *actions, *rewards])
    assert out[-1] == BackwardDone(group_id="g")
    grpo.assert_safe_to_step()
    got = grpo_cases.grads(model)
    model.zero_grad(set_to_none=True)
    grpo_cases.dense_objective(model, plan, "grpo", 1e-6).backward()
    assert grpo_cases.relative_error(got, grpo_cases.grads(model)) < 1e-10


def test_misuse_is_refused_with_clear_messages(run_stage: RunStage) -> None:
    with pytest.raises(
        ConfigError,
        match=r"objective is a dict, which is not a thundersync.engine.objective.StreamingObjective; give it a "
        r"thundersync.RewardLinearBackward \(GRPO\) or a thundersync.OPDStream \(OPD\)$",
    ):
        BackwardStage(objective={})  # type: ignore[arg-type]  # the wrong type is the point
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(tiny_qwen3(torch.float64)))
    early = [ActionGenerated(group_id="g", trajectory_id=0, turn=0, token_ids=[1], final=True)]
    with pytest.raises(
        StageFailed, match="got a ActionGenerated of group 'g', which is not open: it never got its GroupOpened"
    ):
        anyio.run(run_stage, BackwardStage(objective=grpo), early)
    unlisted = [GroupOpened(group_id="g", prompt_tokens=[1])]
    with pytest.raises(StageFailed, match="GroupOpened of group 'g' lists no trajectory ids"):
        anyio.run(run_stage, BackwardStage(objective=grpo), unlisted)
    grpo.discard()
    unfinished = [
        GroupOpened(group_id="g", prompt_tokens=[1], trajectory_ids=[0]),
        ActionGenerated(group_id="g", trajectory_id=0, turn=0, token_ids=[1, 2], final=True),
    ]
    with pytest.raises(StageFailed, match=r"groups 'g' are still open in the objective; .* their reward"):
        anyio.run(run_stage, BackwardStage(objective=grpo), unfinished)
    grpo.discard()
    twice = [
        GroupOpened(group_id="g", prompt_tokens=[1], trajectory_ids=[0]),
        Rewarded(group_id="g", trajectory_id=0, reward=1.0),
        Rewarded(group_id="g", trajectory_id=0, reward=0.5),
    ]
    with pytest.raises(StageFailed, match=r"the reward of trajectory 0 of group 'g' came twice \(1.0, then 0.5\)"):
        anyio.run(run_stage, BackwardStage(objective=grpo), twice)
    with pytest.raises(ConfigError, match="max_grad_norm is 0"):
        StreamingTrainer(grpo, torch.optim.SGD(grpo.run.params), max_grad_norm=0)
    with pytest.raises(ConfigError, match=r"the trainer's objective is a list, which is not a .*StreamingObjective"):
        StreamingTrainer([], torch.optim.SGD(grpo.run.params))  # type: ignore[arg-type]  # the wrong type is the point
