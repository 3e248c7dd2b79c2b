"""Building a :class:`~thundersync.pipeline.graph.Graph` from a :class:`PipelineSpec`.

Each stage gets the runtime object named like its keyword argument, or the one its
``objects = {kwarg = "NAME"}`` table names: the objects passed to :func:`build_graph` first, then
those the spec's ``[objects]`` tables build with their factories (``app/factories/registry.py``). The graph
is validated before it is returned, so a file that would hang or fail to wire fails here, naming
the stage::

    spec = PipelineSpec(stages={"reward": StageSpec("reward", RewardStage.Config(), reads=("generate",)), ...})
    graph = build_graph(spec, scorer=MyVerifier())
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import msgspec

from thundersync._device import resolve_device
from thundersync.app.factories.registry import ALL_FACTORIES
from thundersync.app.files._schema import factory_params, factory_table, reference_params, runtime_params
from thundersync.app.files.definition import ObjectSpec, PipelineSpec, StageSpec, is_reference
from thundersync.app.files.object_graph import build_order, place_hint, runtime_class
from thundersync.app.phases import phase
from thundersync.errors import ConfigError, DefinitionError, GraphError
from thundersync.pipeline.graph import INPUT, Graph
from thundersync.pipeline.stage import Stage
from thundersync.stages import REGISTRY
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage

__all__ = ["assemble_graph", "build_graph", "build_objects"]


def build_objects(spec: PipelineSpec, /, **given: Any) -> dict[str, Any]:
    """The runtime objects of ``spec`` by name: ``given`` ones, else built by their factory, each
    after the objects it references (:func:`~thundersync.app.files.object_graph.build_order`). A factory
    that takes a ``device`` gets ``run.device``, one that takes an ``acceleration`` gets the file's
    ``[acceleration]`` (resolved once, here), one that takes ``deterministic`` gets
    ``run.deterministic``, one that takes ``shard`` gets ``run.shard``, and one that takes
    ``max_staleness`` gets ``run.max_staleness`` (when set), when the object's table gives none."""
    objects = dict(given)
    order = build_order(spec, given)
    if any(_takes(spec.objects[name], "device") for name in order):
        try:
            resolve_device(spec.run.device)  # once, naming run.device, before any object is built
        except ConfigError as error:
            raise DefinitionError(f"run.device: {error}") from None
    try:
        acceleration = msgspec.to_builtins(spec.acceleration.resolved())
    except ConfigError as error:
        raise DefinitionError(f"acceleration: {error}") from None
    if not order:  # all given (build_graph after build_objects): no build phase to show
        return objects
    with phase("build", total=len(order), unit="objects", even=False) as advance:
        for done, name in enumerate(order):
            advance(done, object=name)
            obj = spec.objects[name]
            filled = {
                "device": spec.run.device,
                "acceleration": acceleration,
                "deterministic": spec.run.deterministic,
                "shard": spec.run.shard,
            }
            if spec.run.max_staleness is not None:
                filled["max_staleness"] = spec.run.max_staleness
            extra = {key: value for key, value in filled.items() if _takes(obj, key)}
            if extra:
                obj = ObjectSpec(obj.factory, {**obj.args, **extra}, obj.refs)
            objects[name] = _build_object(name, obj, objects)
        advance(len(order), object="")
    return objects


def _takes(obj: ObjectSpec, param: str) -> bool:
    """Whether the object's factory takes ``param`` and its table does not give it."""
    return param in factory_params(obj.factory) and param not in obj.args


def _build_object(name: str, obj: ObjectSpec, built: dict[str, Any]) -> Any:
    prefix = f"objects.{name}"
    params = reference_params(obj.factory)
    values = {k: v for k, v in obj.args.items() if k not in params}  # the rest hold nested references
    node = factory_table({"factory": obj.factory, **values}, prefix, ["factory", *factory_params(obj.factory)])
    kwargs = {k: getattr(node, k) if k in node.__struct_fields__ else v for k, v in obj.args.items()}
    for place, target in obj.refs.items():
        expected = runtime_class(place_hint(params, place))
        if expected is not None and not _is_instance(built[target], expected):
            raise DefinitionError(
                f"{prefix}.{place}: references {target!r}, a {type(built[target]).__name__}, but this field "
                f"takes a {expected.__name__}"
            )
        if place.isidentifier():  # a whole argument; nested ones are replaced in place below
            kwargs[place] = built[target]
    kwargs = {k: _resolved(v, built) for k, v in kwargs.items()}
    try:
        return ALL_FACTORIES[obj.factory](**kwargs)
    except (TypeError, ValueError, ConfigError) as error:
        raise DefinitionError(f"{prefix}: {obj.factory} failed: {error}") from error


def _resolved(value: Any, built: Mapping[str, Any]) -> Any:
    """``value`` with every ``{ object = "NAME" }`` table in its tables and arrays replaced by the object."""
    if is_reference(value):
        return built[value["object"]]
    if isinstance(value, dict):
        return {k: _resolved(v, built) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolved(v, built) for v in value]
    return value


def _is_instance(obj: Any, cls: type) -> bool:
    try:
        return isinstance(obj, cls)
    except TypeError:  # not a runtime-checkable class
        return True


def build_graph(spec: PipelineSpec, /, **objects: Any) -> Graph:
    """Build and validate the :class:`Graph` of ``spec``; ``objects`` override ``[objects]`` by name.

    A :class:`~thundersync.app.checkpoints.checkpoint.Checkpointer` without a ``source`` gets the graph's
    source stage when there is exactly one (so that ``--resume`` skips the consumed batches).
    """
    built = build_objects(spec, **objects)
    stages = {name: _make_stage(name, node, built, spec.run.deterministic) for name, node in spec.stages.items()}
    graph = assemble_graph(spec, stages)
    _attach_source(graph, built)
    return graph


def _attach_source(graph: Graph, objects: Mapping[str, Any]) -> None:
    """Give checkpointers without a source the graph's only source stage (their data position)."""
    # a Checkpointer exists only once its module is imported; importing it here would load torch for any file
    checkpoint = sys.modules.get("thundersync.app.checkpoints.checkpoint")
    if checkpoint is None:
        return
    sources = [node.stage for node in graph if isinstance(node.stage, SourceStage)]
    for obj in objects.values():
        if isinstance(obj, checkpoint.Checkpointer) and obj.source is None and len(sources) == 1:
            obj.source = sources[0]


def assemble_graph(spec: PipelineSpec, stages: Mapping[str, Stage]) -> Graph:
    """The validated :class:`Graph` of ``spec`` over these stage instances (one per stage of the spec)."""
    graph = Graph()
    for name, node in spec.stages.items():
        graph.add(
            name,
            stages[name],
            reads=node.reads,
            capacity=node.capacity or spec.run.capacity,
            output=node.output,
            feedback=node.feedback,
        )
    _check_acyclic(graph)
    graph.validate()
    _check_required_inputs(graph)
    _check_policy_published(spec, graph)
    _check_staleness(spec, graph)
    _limit_steps(spec, graph)
    return graph


def _limit_steps(spec: PipelineSpec, graph: Graph) -> None:
    """``[run] steps``: the graph's one source stage emits that many batches (one step each)."""
    if spec.run.steps is None:
        return
    sources = [node.name for node in graph if isinstance(node.stage, SourceStage)]
    if len(sources) != 1:
        raise DefinitionError(
            f"run.steps: {spec.run.steps} steps need exactly one source stage to emit that many batches, "
            f"but the graph has {len(sources)} ({', '.join(sources) or 'none'}); drop run.steps and bound "
            "the sources with their repeat, or keep one source"
        )
    stage = graph[sources[0]].stage
    assert isinstance(stage, SourceStage)
    stage.limit_batches(spec.run.steps)


def _check_acyclic(graph: Graph) -> None:
    """An undeclared cycle, named by the file path of the stage whose ``reads`` closes it."""
    cycle = graph.cycle()
    if cycle is not None:
        stage, upstream = cycle[0], cycle[1]
        raise DefinitionError(
            f"stages.{stage}.reads: stages form a cycle: {' -> '.join(reversed(cycle))}, which would never "
            f"end; if the loop is intended, move {upstream!r} from reads to feedback "
            f"(feedback = [{upstream!r}] in [stages.{stage}])"
        )


def _check_policy_published(spec: PipelineSpec, graph: Graph) -> None:
    """A generate stage waiting on a PolicyClock needs a step stage publishing to that same clock,
    or it would wait forever for the policy of its second batch."""
    published = {id(node.stage.policy) for node in graph if isinstance(node.stage, StepStage)}
    for node in graph:
        if (
            isinstance(node.stage, GenerateStage)
            and node.stage.policy is not None
            and id(node.stage.policy) not in published
        ):
            clock = spec.stages[node.name].objects.get("policy", "policy")
            raise DefinitionError(
                f"stages.{node.name}.objects.policy: generate waits on the policy clock "
                f"{clock!r} before each batch, but no step stage publishes to it, so a run of more "
                f"than one batch would hang; add a step stage with the same policy "
                f'(reads = ["<close stage>"]), or drop the policy from {node.name!r}'
            )


def _check_staleness(spec: PipelineSpec, graph: Graph) -> None:
    """A policy clock with ``max_staleness >= 1`` lets generate start batch ``n + 1`` before step
    ``n``: every backward stage must hold such batches (it needs the same clock), and every close
    stage must wait for ``backward`` (or a held batch could be announced ready before it went in)."""
    clocks = {
        id(policy): policy
        for node in graph
        if (policy := getattr(node.stage, "policy", None)) is not None and getattr(policy, "max_staleness", 0) > 0
    }
    if not clocks:
        return
    k = max(clock.max_staleness for clock in clocks.values())
    if spec.run.deterministic:
        raise DefinitionError(
            f"run.deterministic: the policy clock has max_staleness = {k}, so which policy version samples each "
            "token depends on when the steps land, and no two runs are bitwise equal; set max_staleness = 0 for "
            "a deterministic run, or deterministic = false"
        )
    for node in graph:
        if isinstance(node.stage, BackwardStage) and id(node.stage.policy) not in clocks:
            raise DefinitionError(
                f"stages.{node.name}.objects.policy: the policy clock has max_staleness = {k}, so generate "
                f"starts a batch before the step of the one before it, but the backward stage {node.name!r} "
                "does not wait on that clock and would feed the next batch into the objective before the step; "
                'give it the same clock (objects = { policy = "<the clock\'s name>" }), or set max_staleness = 0'
            )
        if isinstance(node.stage, CloseStage) and "backward" not in node.stage.config.wait_for:
            raise DefinitionError(
                f"stages.{node.name}.wait_for: the policy clock has max_staleness = {k}, so the backward stage holds "
                f"the next batch until its version is live, but {node.name!r} does not wait for backward and could "
                'announce that batch ready before it went into the objective; add "backward" to wait_for, or set '
                "max_staleness = 0"
            )


def _check_required_inputs(graph: Graph) -> None:
    """Stages with ``required_inputs()`` (close) must read from producers of each type, or they
    would wait forever (the graph would never finish)."""
    for node in graph:
        required = getattr(node.stage, "required_inputs", None)
        if required is None or INPUT in node.reads:  # an application may send anything
            continue
        producers = [graph[name].stage for name in node.reads if name in graph]
        for wanted in required():
            if not any(issubclass(made, wanted) for stage in producers for made in stage.produces):
                raise GraphError(
                    f"stage {node.name!r} waits for {wanted.__name__} events, but none of the "
                    f"stages it reads from ({', '.join(node.reads)}) produces them; add the "
                    f"stage that does to its reads, or stop waiting for it"
                )


def stage_class(name: str, node: StageSpec) -> tuple[type[Stage], dict[str, tuple[Any, bool]]]:
    """The stage type of ``stages.NAME`` and its runtime parameters, after checking that its
    ``objects`` table names only parameters the stage takes (shared by building and ``check``)."""
    prefix = f"stages.{name}"
    cls = REGISTRY.get(node.type)
    if cls is None:
        raise DefinitionError(f"{prefix}.type: unknown stage type {node.type!r}; known: {', '.join(REGISTRY)}")
    params = runtime_params(cls)
    extra = sorted(set(node.objects) - set(params))
    if extra:
        raise DefinitionError(
            f"{prefix}.objects.{extra[0]}: a {node.type!r} stage takes no runtime object "
            f"{extra[0]!r}; it takes: {', '.join(params) or 'none'}"
        )
    return cls, params


def _make_stage(name: str, node: StageSpec, objects: dict[str, Any], deterministic: bool = False) -> Stage:
    prefix = f"stages.{name}"
    cls, params = stage_class(name, node)
    if deterministic and issubclass(cls, BackwardStage):  # run.deterministic: whole groups, in order
        config = node.config if isinstance(node.config, BackwardStage.Config) else BackwardStage.Config()
        node = msgspec.structs.replace(node, config=msgspec.structs.replace(config, ordered=True))
    kwargs = {param: _bind(prefix, node, param, hint, required, objects) for param, (hint, required) in params.items()}
    try:
        return cls(node.config, **{k: v for k, v in kwargs.items() if v is not None})
    except (TypeError, ConfigError) as error:
        raise DefinitionError(f"{prefix}: {error}") from error


def _bind(prefix: str, node: StageSpec, param: str, hint: Any, required: bool, objects: dict[str, Any]) -> Any:
    target = node.objects.get(param, param)
    if target not in objects:
        if param in node.objects:
            raise DefinitionError(
                f"{prefix}.objects.{param}: names {target!r}, which is neither defined under "
                f"[objects] nor passed to build_graph; objects: {', '.join(objects) or 'none'}"
            )
        if required:
            raise DefinitionError(
                f"{prefix}: a {node.type!r} stage needs a runtime object {param!r}; add an "
                f"[objects.{param}] table (factories: {', '.join(ALL_FACTORIES)}) or pass "
                f"{param}=... to build_graph"
            )
        return None
    obj = objects[target]
    expected = runtime_class(hint)
    if expected is not None and not isinstance(obj, expected):
        raise DefinitionError(
            f"{prefix}: runtime object {target!r} is a {type(obj).__name__}, but a "
            f"{node.type!r} stage needs a {expected.__name__} for {param!r}"
        )
    return obj
