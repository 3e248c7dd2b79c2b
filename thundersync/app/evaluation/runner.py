"""`Evaluation`: ``[eval]`` runs the policy on a held-out set, in a graph of its own.

::

    [eval]
    tasks = "heldout"        # a tasks object (jsonl-tasks, dataset, arithmetic-tasks...)
    every = 10               # after every 10th optimizer step, and at the end (at_end = true)
    samples = 4              # n samples per task: eval_pass_at_k with k = samples (or k = ...)
    temperature = 0.0        # greedy

An evaluation builds a graph of its own from the training graph's runtime objects: a source of the
held-out tasks (``samples`` each; group ids ``eval/N``), a copy of the rollout stage (``generate``
with its generator and tool parser and the tool stage on its feedback edge, or ``agent-app`` with
its app) with the evaluation's sampling, and the reward (the reward stage's scorer, ``scorer``, or
the app's own rewards). It has no backward or step stage: it never touches a training batch, the
gradients or the optimizer's state. When the tool runner keeps a sandbox per trajectory (a grader
scores in it), a close stage gives each back once its trajectory is scored.

During ``thundersync run`` it runs inside the step stage's checkpoint hook (:class:`EvalHook`):
after the optimizer step, before the step is announced and the next policy published, so the
weights are those of the step and do not move until it ends (the step stage waits for it). With
``max_staleness = 0`` generation of the next batch has not started; with k >= 1 the batches that
started early may go on generating beside it, on the same weights. Its record
(:func:`~thundersync.app.evaluation.scores.eval_record`, with ``step``) is written as an
``"event": "eval"`` line of the metrics file (and to TensorBoard and W&B). Under a data-parallel
launch, rank 0 alone evaluates. ``thundersync eval FILE --checkpoint DIR`` runs it once, alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from time import perf_counter
from typing import Any, ClassVar

import msgspec

from thundersync.app.evaluation.scores import eval_record
from thundersync.app.files.definition import EvalSettings
from thundersync.errors import ConfigError
from thundersync.events import ActionGenerated, EventBase, Id, PromptSubmitted, Rewarded
from thundersync.pipeline import Graph, Pipeline
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.stages.agent_app import AgentAppStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage, Scorer, TaskScorer, TrajectoryScorer
from thundersync.stages.step import Checkpointer, StepStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.tasks.data import Task, TaskSource, TaskStream
from thundersync.tools import TrajectoryToolRunner

__all__ = ["EvalHook", "Evaluation", "attach_evaluation", "evaluate_alone"]

Rollout = GenerateStage | AgentAppStage


class _HeldOut(Stage):
    """The evaluation's source: every held-out task once, ``samples`` trajectories each."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = ()
    produces: ClassVar[tuple[type[EventBase], ...]] = (PromptSubmitted,)

    def __init__(self, tasks: list[Task], samples: int) -> None:
        super().__init__()
        self.tasks, self.samples = tasks, samples

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        for index, task in enumerate(self.tasks):
            await outbox.send(
                PromptSubmitted(
                    group_id=f"eval/{index}",
                    prompt_tokens=list(task.prompt_ids),
                    num_trajectories=self.samples,
                    batch_id="eval",
                    groups_in_batch=len(self.tasks),
                    task=dict(task.fields),
                )
            )


class Evaluation:
    """Evaluates with ``settings`` over the built ``objects`` and training ``graph`` (module docstring)."""

    def __init__(self, settings: EvalSettings, objects: Mapping[str, Any], graph: Graph) -> None:
        self.settings = settings
        source = objects.get(settings.tasks)
        if isinstance(source, TaskSource):
            self.tasks = source.tasks()
        elif isinstance(source, TaskStream):
            self.tasks = list(source.stream(0, None))
        else:
            raise ConfigError(f"eval.tasks names {settings.tasks!r}, which is not a tasks object of the file")
        if not self.tasks:
            raise ConfigError(f"eval.tasks: the held-out set {settings.tasks!r} has no task")
        self.k = settings.k if settings.k is not None else settings.samples
        self._rollout_name, self.rollout = _rollout(settings, graph)
        tools = [graph[name].stage for name in graph[self._rollout_name].feedback]
        self.tools = next((t for t in tools if isinstance(t, ToolExecuteStage)), None)
        self.scorer = _scorer(settings, objects, graph, self.rollout)

    def graph(self) -> Graph:
        """A fresh evaluation graph (stages hold per-run state, so each run gets new ones)."""
        graph = Graph().add("held-out", _HeldOut(self.tasks, self.settings.samples))
        rollout, loop = (
            self._copy(),
            ["tools"] if self.tools is not None and isinstance(self.rollout, GenerateStage) else [],
        )
        graph.add("rollout", rollout, reads=["held-out"], feedback=loop, output=True)
        if loop:
            assert self.tools is not None
            graph.add(
                "tools", ToolExecuteStage(self.tools.config, tools=self.tools.tools), reads=["rollout"], output=True
            )
        if self.scorer is not None:
            graph.add("reward", RewardStage(scorer=self.scorer), reads=["rollout", *loop], output=True)
            if loop and isinstance(self.tools.tools if self.tools else None, TrajectoryToolRunner):
                assert self.tools is not None  # each trajectory's sandbox goes back once it is scored
                graph.add("close", CloseStage(tools=self.tools.tools), reads=["rollout", "reward"], output=True)
        return graph

    def _copy(self) -> Rollout:
        options: dict[str, Any] = {"temperature": self.settings.temperature}
        if self.settings.max_new_tokens is not None:
            options["max_new_tokens"] = self.settings.max_new_tokens
        stage = self.rollout
        if isinstance(stage, GenerateStage):
            generate = msgspec.structs.replace(stage.config, **options)
            return GenerateStage(generate, generator=stage.generator, tool_calls=stage.tool_calls)
        rewards = "app" if self.scorer is None else "stage"
        app = msgspec.structs.replace(stage.config, port=0, rewards=rewards, **options)
        return AgentAppStage(app, app=stage.app, generator=stage.generator, chat=stage.chat, tokenizer=stage.tokenizer)

    async def run(self, step: int) -> dict[str, Any]:
        """Evaluate the current policy; the record of the run (``step`` and the ``eval_*`` keys)."""
        start = perf_counter()
        rewards: dict[Id, list[float]] = {}
        tokens = 0
        async with Pipeline(self.graph()) as pipeline:
            await pipeline.close()
            async for event in pipeline.results():
                if isinstance(event, Rewarded):
                    rewards.setdefault(event.group_id, []).append(event.reward)
                elif isinstance(event, ActionGenerated):
                    tokens += len(event.token_ids)
        record = eval_record(
            rewards,
            k=self.k,
            pass_threshold=self.settings.pass_threshold,
            tokens=tokens,
            seconds=perf_counter() - start,
        )
        return {"step": step, **record}


def _rollout(settings: EvalSettings, graph: Graph) -> tuple[str, Rollout]:
    found = [node for node in graph if isinstance(node.stage, (GenerateStage, AgentAppStage))]
    if settings.stage is not None:
        found = [node for node in found if node.name == settings.stage]
    if len(found) != 1:
        names = ", ".join(node.name for node in graph if isinstance(node.stage, (GenerateStage, AgentAppStage)))
        raise ConfigError(
            f"[eval] needs one rollout stage (generate or agent-app) to copy; found {names or 'none'}"
            + ("" if settings.stage is None else f" (eval.stage = {settings.stage!r})")
        )
    stage = found[0].stage
    assert isinstance(stage, (GenerateStage, AgentAppStage))
    return found[0].name, stage


def _scorer(
    settings: EvalSettings, objects: Mapping[str, Any], graph: Graph, rollout: Rollout
) -> Scorer | TaskScorer | TrajectoryScorer | None:
    if settings.scorer is not None:
        scorer = objects.get(settings.scorer)
        if not isinstance(scorer, (Scorer, TaskScorer, TrajectoryScorer)):
            raise ConfigError(f"eval.scorer names {settings.scorer!r}, which is not a scorer object of the file")
        return scorer
    if isinstance(rollout, AgentAppStage) and rollout.config.rewards == "app":
        return None
    scorers = [node.stage.scorer for node in graph if isinstance(node.stage, RewardStage)]
    if len(scorers) != 1:
        raise ConfigError(
            f"[eval] scores with the reward stage's scorer, and the file has {len(scorers)} reward stages; "
            "name one with eval.scorer"
        )
    return scorers[0]


class EvalHook:
    """A :class:`~thundersync.stages.step.Checkpointer` that evaluates every ``every`` steps and
    at the end, after the checkpointer it wraps (``inner``); each record goes to ``write``."""

    def __init__(
        self, evaluation: Evaluation, write: Callable[[dict[str, Any]], None], inner: Checkpointer | None = None
    ) -> None:
        self.evaluation, self.write, self.inner = evaluation, write, inner
        self._evaluated: int | None = None

    async def stepped(self, step: int, batch_id: Id) -> None:
        if self.inner is not None:
            await self.inner.stepped(step, batch_id)
        every = self.evaluation.settings.every
        if every and step % every == 0:
            await self._evaluate(step)

    async def finished(self, step: int) -> None:
        if self.inner is not None:
            await self.inner.finished(step)
        if self.evaluation.settings.at_end and self._evaluated != step:
            await self._evaluate(step)

    async def _evaluate(self, step: int) -> None:
        self.write(await self.evaluation.run(step))
        self._evaluated = step

    def __getattr__(self, name: str) -> Any:  # the wrapped checkpointer's directory, saved_step...
        if self.inner is None:
            raise AttributeError(name)
        return getattr(self.inner, name)


def attach_evaluation(graph: Graph, evaluation: Evaluation, write: Callable[[dict[str, Any]], None]) -> None:
    """Make the graph's step stage evaluate (its checkpointer wrapped in an :class:`EvalHook`)."""
    steps = [node.stage for node in graph if isinstance(node.stage, StepStage)]
    if len(steps) != 1:
        raise ConfigError(f"[eval] during a run needs one step stage to evaluate after, found {len(steps)}")
    steps[0].checkpointer = EvalHook(evaluation, write, steps[0].checkpointer)


async def evaluate_alone(evaluation: Evaluation, objects: Mapping[str, Any], step: int) -> dict[str, Any]:
    """One evaluation outside a run (``thundersync eval``), the objects that hold resources entered."""
    async with AsyncExitStack() as stack:
        for obj in objects.values():
            if hasattr(obj, "__aenter__") and hasattr(obj, "__aexit__"):
                await stack.enter_async_context(obj)
        return await evaluation.run(step)
