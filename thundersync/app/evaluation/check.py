"""``thundersync check`` of ``[eval]``: what it names exists and fits, without building anything."""

from __future__ import annotations

from thundersync.app.files.definition import PipelineSpec
from thundersync.app.files.object_graph import check_fits, factory_returns, runtime_class
from thundersync.errors import DefinitionError
from thundersync.stages.agent_app import AgentAppStage
from thundersync.stages.reward import Scorer, TaskScorer, TrajectoryScorer
from thundersync.tasks.data import TaskSource

__all__ = ["check_eval"]

_ROLLOUTS = ("generate", "agent-app")


def check_eval(spec: PipelineSpec) -> None:
    """``[eval]``'s tasks, stage and scorer exist and fit; ``k <= samples``; a reward to read."""
    settings = spec.eval
    if settings is None:
        return
    objects = ", ".join(spec.objects) or "none"
    if settings.tasks not in spec.objects:
        raise DefinitionError(
            f"eval.tasks: names {settings.tasks!r}, which is not an object of the file; objects: {objects}"
        )
    check_fits("eval.tasks", TaskSource, spec.objects[settings.tasks].factory, settings.tasks)
    if settings.k is not None and settings.k > settings.samples:
        raise DefinitionError(
            f"eval.k: {settings.k} is more than eval.samples = {settings.samples}; pass@k draws k of the n samples"
        )
    rollouts = [name for name, stage in spec.stages.items() if stage.type in _ROLLOUTS]
    if settings.stage is not None and settings.stage not in rollouts:
        raise DefinitionError(
            f"eval.stage: {settings.stage!r} is not a generate or agent-app stage; those: {', '.join(rollouts) or 'none'}"
        )
    if settings.stage is None and len(rollouts) != 1:
        raise DefinitionError(
            f"eval: the file has {len(rollouts)} rollout stages ({', '.join(rollouts) or 'none'}); name one with eval.stage"
        )
    rollout = spec.stages[settings.stage or rollouts[0]]
    _check_scorer(spec, rollout.config)
    if settings.every and not any(stage.type == "step" for stage in spec.stages.values()):
        raise DefinitionError("eval.every: evaluating every N steps needs a step stage; set every = 0 or add one")


def _check_scorer(spec: PipelineSpec, rollout: object) -> None:
    settings = spec.eval
    assert settings is not None
    if settings.scorer is not None:
        if settings.scorer not in spec.objects:
            raise DefinitionError(f"eval.scorer: names {settings.scorer!r}, which is not an object of the file")
        made = runtime_class(factory_returns(spec.objects[settings.scorer].factory))
        if made is not None and not any(issubclass(made, kind) for kind in (Scorer, TaskScorer, TrajectoryScorer)):
            raise DefinitionError(
                f"eval.scorer: {settings.scorer!r} makes a {made.__name__}, which has none of score, score_task and score_trajectory"
            )
        return
    app_rewards = isinstance(rollout, AgentAppStage.Config) and rollout.rewards == "app"
    if not app_rewards and not any(stage.type == "reward" for stage in spec.stages.values()):
        raise DefinitionError(
            "eval: nothing scores the held-out samples; add a reward stage, name a scorer object with eval.scorer, "
            'or use an agent-app stage with rewards = "app"'
        )
