"""Bounded staleness (``max_staleness = k``) with on-policy distillation: the backward stage holds
a later batch's groups, with their teacher scores, until the step before it published its
version, and each step is the OPD gradient of exactly its own batch, with each token's behaviour
log-prob the one it was sampled with (decision 082).

The graph is generate (two turns, a scripted tool between them) -> tool-execute -> teacher ->
backward -> close -> step on a tiny fp64 model; batch 0 finishes last (tests/stages/test_staleness.py's
generator), so batches 1..k wait outside the objective, scored, while step 0 waits for batch 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.opd import opd_cases
from tests.stages.test_staleness import _Feed, _FirstBatchLast, _GradientsOnly, _Recorder, _run
from thundersync.engine import StreamingRun
from thundersync.events import ActionGenerated, EventBase, GroupOpened, StepDone, TeacherScored, ToolObserved
from thundersync.opd import OPDStream
from thundersync.opd.loss import Advantage, surrogate_sum
from thundersync.pipeline import Graph
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.step import StepStage, StreamingTrainer
from thundersync.stages.teacher import TeacherStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import FakeTeacher, ScriptedTool

VOCAB = opd_cases.VOCAB


def opd_graph(
    objective: Any, clock: PolicyClock, generator: Any, recorder: _Recorder, optimizer: Any
) -> tuple[Graph, _Feed]:
    """generate <-> tool-execute, teacher, backward (holding on ``clock``), close, step."""
    tools = ScriptedTool(vocab_size=VOCAB, end_token=VOCAB - 1)
    backward = BackwardStage(objective=objective, policy=clock)
    backward.feed = feed = _Feed(objective, clock)
    graph = (
        Graph()
        .add(
            "generate",
            GenerateStage(
                GenerateStage.Config(turns=2, max_new_tokens=3), generator=generator, policy=clock, tool_calls=tools
            ),
            reads=["input"],
            feedback=["tool-execute"],
        )
        .add("tool-execute", ToolExecuteStage(tools=tools), reads=["generate"])
        .add("teacher", TeacherStage(teacher=FakeTeacher()), reads=["generate", "tool-execute"])
        .add("record", recorder, reads=["generate", "tool-execute", "teacher"])
        .add("backward", backward, reads=["generate", "tool-execute", "teacher"])
        .add(
            "close",
            CloseStage(CloseStage.Config(wait_for=("teacher", "backward"))),
            reads=["generate", "teacher", "backward"],
        )
        .add(
            "step",
            StepStage(trainer=StreamingTrainer(objective, optimizer), policy=clock),
            reads=["close"],
            output=True,
        )
    )
    return graph, feed


def batch_plan(events: list[EventBase], batch: int) -> opd_cases.Plan:
    """Batch ``batch``'s trajectories as the events recorded them: turns in order, every action
    token scored, with its teacher and behaviour log-probs (an empty action or observation adds nothing)."""
    teacher = {
        (e.group_id, e.trajectory_id, e.turn): e.teacher_logprobs for e in events if isinstance(e, TeacherScored)
    }
    plan: opd_cases.Plan = {}
    for opened in (e for e in events if isinstance(e, GroupOpened) and e.batch_id == batch):
        group = plan[str(opened.group_id)] = opd_cases.Group(list(opened.prompt_tokens))
        for t in opened.trajectory_ids:
            turns = []
            for e in events:
                if not isinstance(e, ActionGenerated | ToolObserved) or (e.group_id, e.trajectory_id) != (
                    opened.group_id,
                    t,
                ):
                    continue
                n = len(e.token_ids)
                if isinstance(e, ToolObserved) and n:
                    turns.append(opd_cases.Turn(list(e.token_ids), [False] * n, [], None))
                elif isinstance(e, ActionGenerated) and n:
                    q, b = list(teacher[(e.group_id, t, e.turn)]), list(e.behaviour_logprobs)
                    turns.append(opd_cases.Turn(list(e.token_ids), [True] * n, q, b))
            group.trajectories[str(t)] = opd_cases.Trajectory(turns)
    return plan


def as_dict(model: torch.nn.Module, grads: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return {name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(params, grads)}


@pytest.mark.parametrize(("k", "advantage"), [(1, "behaviour"), (2, "behaviour"), (1, "learner")])
def test_opd_later_batches_wait_scored_outside_the_objective_and_each_step_is_its_batchs_opd_gradient(
    k: int, advantage: Advantage
) -> None:
    model = opd_cases.tiny_qwen3(torch.float64)
    opd = OPDStream(StreamingRun(model), pack_tokens=16, advantage=advantage)
    clock, generator, recorder = PolicyClock(max_staleness=k), _FirstBatchLast(k), _Recorder()
    optimizer = _GradientsOnly(opd.run.params)
    graph, feed = opd_graph(opd, clock, generator, recorder, optimizer)
    out = _run(graph)
    assert [(e.batch_id, e.policy_version) for e in out if isinstance(e, StepDone)] == [(b, b + 1) for b in range(4)]
    finished = generator.finished
    assert max(finished.index(b) for b in range(1, k + 1)) < finished.index(0)  # batches 1..k finished first
    events = recorder.events
    started = {e.batch_id: e.policy_version for e in events if isinstance(e, GroupOpened)}
    assert all(started[b] == 0 for b in range(k + 1))  # up to k versions early
    for group_id, version in feed.opened:  # the learner saw each batch only on its own version
        assert version == int(str(group_id).split(".")[0]), (group_id, version)
    assert any(isinstance(e, ToolObserved) and e.token_ids for e in events)  # observations in the chains
    for batch, got in enumerate(optimizer.steps):
        want = opd_cases.dense_reference_grads(model, batch_plan(events, batch), "token_mean", advantage)
        assert opd_cases.relative_error(as_dict(model, got), want) < 1e-10, batch


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_given_a_prefix_a_stale_tokens_expected_gradient_is_the_reverse_kl_one_only_with_the_learner_advantage(
    seed: int,
) -> None:
    """Over every token y an older student mu samples after a prefix (exact, by enumeration): the
    learner advantage gives grad KL(pi || T), the behaviour one grad [KL(pi || T) - KL(pi || mu)]."""
    student = opd_cases.tiny_qwen3(torch.float64)
    older = opd_cases.tiny_qwen3(torch.float64)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p, q in zip(older.parameters(), student.parameters()):
            p.copy_(q + 0.05 * torch.randn(q.shape, generator=generator, dtype=q.dtype))
    prefix = torch.randint(0, VOCAB, (1, 5), generator=generator)
    lp = torch.log_softmax(student(prefix).logits[0, -1], -1)  # log pi(y | prefix), every y
    with torch.no_grad():
        b = torch.log_softmax(older(prefix).logits[0, -1], -1)  # log mu(y | prefix)
        q = torch.log_softmax(3 * torch.randn(VOCAB, generator=generator, dtype=torch.float64), -1)

    def expected(advantage: Advantage) -> dict[str, torch.Tensor]:  # sum_y mu(y) grad term(y)
        terms = [b[y].exp() * surrogate_sum(lp[y : y + 1], q[y : y + 1], b[y : y + 1], advantage) for y in range(VOCAB)]
        return _grads(student, torch.stack(terms).sum())

    pi = lp.exp()
    reverse_kl = _grads(student, (pi * (lp - q)).sum())
    minus_old = _grads(student, (pi * (lp - q)).sum() - (pi * (lp - b)).sum())
    assert opd_cases.relative_error(expected("learner"), reverse_kl) < 1e-10
    assert opd_cases.relative_error(expected("behaviour"), minus_old) < 1e-10
    assert opd_cases.relative_error(expected("behaviour"), reverse_kl) > 1e-6  # the bias is there


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    grads = opd_cases.collect_grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def test_a_pipeline_files_opd_objective_takes_the_advantage_option(tmp_path: Path) -> None:
    from tests.app.test_deterministic_file import _opd_file
    from thundersync.app.files.build import build_graph
    from thundersync.app.files.definition import load

    file = _opd_file(tmp_path)
    assert build_graph(load(file, []))["backward"].stage.objective.config.advantage == "behaviour"  # type: ignore[attr-defined]
    graph = build_graph(load(file, ['objects.objective.advantage="learner"', "run.max_staleness=1"]))
    assert graph["backward"].stage.objective.config.advantage == "learner"  # type: ignore[attr-defined]
