"""``thundersync check``: validate a whole pipeline file without building any object.

:func:`check_pipeline` verifies what :func:`~thundersync.app.files.build.build_graph` would, short of
calling a factory (no model is loaded, no sandbox started, no server contacted):

- the object graph: references, their order, cycles, and that each referenced factory's product
  fits the parameter's annotation (:mod:`thundersync.app.files.object_graph`); field types were checked
  against the factories' signatures when the file was loaded;
- each stage's runtime objects: the names exist, required ones are given, and the factory's product
  fits the stage's parameter;
- the stage graph's wiring, over stand-in stages whose runtime objects are :class:`Unbuilt`
  placeholders: undeclared cycles, reads without common event types, stages that would wait
  forever, a policy clock nobody publishes to;
- ``[eval]``: its tasks, stage and scorer exist and fit, ``k <= samples``, something scores
  (:mod:`thundersync.app.evaluation.check`);
- ``[run]``: the tensorboard package is installed when ``tensorboard`` is set, wandb when ``[run.wandb]`` is (``device`` was
  checked when the file was loaded; CUDA's presence is checked at ``run``);
- an ``openai-generator``'s ``api_key_env`` names a key's variable (:func:`~thundersync.app.files.trust.check_key_variable`);
- options that the file passes on to a library: an ``optimizer``'s ``name`` is a ``torch.optim``
  class that takes its options (and ``maximize`` suits the objective), a ``vllm-generator``'s
  engine options are fields of vLLM's ``EngineArgs`` (when vLLM is importable here; otherwise a
  warning says they were not checked), and every ``lr-schedule`` is stepped by a
  ``streaming-trainer`` of the same optimizer (else its learning rate would never change).

What only a built object can tell (a model directory that does not exist, a factory's own value
checks) fails at ``run``, naming the object.
"""

from __future__ import annotations

from typing import Any

from thundersync._logging import get_logger
from thundersync.app.evaluation.check import check_eval
from thundersync.app.factories.registry import ALL_FACTORIES
from thundersync.app.files._schema import factory_params, factory_returns
from thundersync.app.files.build import assemble_graph, stage_class
from thundersync.app.files.definition import PipelineSpec, StageSpec
from thundersync.app.files.object_graph import build_order, check_fits
from thundersync.app.files.trust import check_key_variable
from thundersync.app.metrics.tensorboard import require_tensorboard
from thundersync.app.metrics.wandb import require_wandb
from thundersync.errors import ConfigError, DefinitionError
from thundersync.pipeline.graph import Graph
from thundersync.pipeline.stage import Stage

__all__ = ["Unbuilt", "check_pipeline"]

_log = get_logger(__name__)


class Unbuilt:
    """Stands for the object ``name`` (made by ``factory``) in a checked, unbuilt graph.

    Class attributes of the factory's product (an objective's ``signal``...) read through, so
    that graph checks which depend on them see the real values.
    """

    def __init__(self, name: str, factory: str) -> None:
        self.name, self.factory = name, factory

    def __getattr__(self, attr: str) -> Any:
        product = factory_returns(self.factory)
        if isinstance(product, type) and not attr.startswith("__"):
            return getattr(product, attr)
        raise AttributeError(f"object {self.name!r} is not built (thundersync check builds none): no {attr!r}")

    def __repr__(self) -> str:
        return f"Unbuilt({self.name!r}, factory={self.factory!r})"


def check_pipeline(spec: PipelineSpec) -> Graph:
    """Validate ``spec`` as :func:`build_graph` would, without building objects; returns the graph
    of stand-in stages (its nodes name the stages and their reads, nothing more: never run it)."""
    check_run_settings(spec)
    build_order(spec)
    check_eval(spec)
    _check_options(spec)
    _check_schedules(spec)
    placeholders = {name: Unbuilt(name, obj.factory) for name, obj in spec.objects.items()}
    stages = {name: _stand_in(name, node, spec, placeholders) for name, node in spec.stages.items()}
    return assemble_graph(spec, stages)


def check_run_settings(spec: PipelineSpec, *, data_parallel: bool = False) -> None:
    """What ``[run]`` needs besides its schema: the tensorboard package for ``tensorboard``, the
    wandb package for ``[run.wandb]``, and under a data-parallel launch a ``device`` without a GPU
    index (each rank takes its own)."""
    if spec.run.tensorboard is not None:
        require_tensorboard()
    if spec.run.wandb is not None:
        require_wandb()
    if data_parallel and spec.run.device.startswith("cuda:"):
        raise DefinitionError(
            f"run.device: {spec.run.device!r} would put every rank of a data-parallel launch on one GPU; "
            'give "cuda" or "auto" (each rank takes cuda:LOCAL_RANK)'
        )


def _check_options(spec: PipelineSpec) -> None:
    """The options of optimizers and vLLM engines, checked against torch's and vLLM's own signatures,
    and the variable an openai-generator reads its key from."""
    for name, obj in spec.objects.items():
        try:
            if obj.factory == "optimizer":
                from thundersync.app.factories import training  # torch.optim: only for files that name one

                objective = spec.objects.get(obj.refs.get("objective", ""))
                signal = None if objective is None else getattr(factory_returns(objective.factory), "signal", None)
                own = factory_params(obj.factory)  # name, shard_state: the rest are the class's options
                options = {k: v for k, v in obj.args.items() if k not in own}
                training.optimizer_options(obj.args["name"], options, signal)
            elif obj.factory == "openai-generator" and isinstance(obj.args.get("api_key_env"), str):
                check_key_variable(obj.args["api_key_env"], allow_any=obj.args.get("allow_any_env") is True)
            elif obj.factory == "vllm-generator":
                from thundersync.app.factories import generators

                own = factory_params(obj.factory)
                note = generators.check_vllm_options({k: v for k, v in obj.args.items() if k not in own})
                if note is not None:
                    _log.warning("vllm_options_not_checked", object=f"objects.{name}", reason=note)
        except ConfigError as error:
            raise DefinitionError(f"objects.{name}.{error}") from None


def _check_schedules(spec: PipelineSpec) -> None:
    """Every lr-schedule is stepped by a trainer that steps the schedule's own optimizer."""
    trainers = {n: o for n, o in spec.objects.items() if o.factory == "streaming-trainer"}
    for name, obj in spec.objects.items():
        if obj.factory != "lr-schedule":
            continue
        users = [n for n, trainer in trainers.items() if trainer.refs.get("schedule") == name]
        if not users:
            raise DefinitionError(
                f"objects.{name}: no streaming-trainer steps this lr-schedule, so its learning rate would never "
                f'change; give it to the trainer (schedule = {{ object = "{name}" }})'
            )
        for user in users:
            stepped = trainers[user].refs.get("optimizer")
            if stepped != obj.refs.get("optimizer"):
                raise DefinitionError(
                    f"objects.{user}.schedule: the schedule {name!r} drives the optimizer "
                    f"{obj.refs.get('optimizer')!r}, but this trainer steps {stepped!r}; reference the same optimizer"
                )


def _stand_in(name: str, node: StageSpec, spec: PipelineSpec, placeholders: dict[str, Unbuilt]) -> Stage:
    """The stage ``name`` with its config and placeholder objects, its constructor not called."""
    prefix = f"stages.{name}"
    cls, params = stage_class(name, node)
    stage = cls.__new__(cls)
    Stage.__init__(stage, node.config)
    for param, (hint, required) in params.items():
        target = node.objects.get(param, param)
        if target in placeholders:
            check_fits(f"{prefix}.objects.{param}", hint, spec.objects[target].factory, target)
        elif param in node.objects:
            raise DefinitionError(
                f"{prefix}.objects.{param}: names {target!r}, which is not defined under [objects]; "
                f"objects: {', '.join(placeholders) or 'none'}"
            )
        elif required:
            raise DefinitionError(
                f"{prefix}: a {node.type!r} stage needs a runtime object {param!r}; add an "
                f"[objects.{param}] table (factories: {', '.join(ALL_FACTORIES)})"
            )
        setattr(stage, param, placeholders.get(target))
    return stage
