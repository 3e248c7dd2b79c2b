"""Pipeline definition files: TOML decoded straight into msgspec Structs, and the graph they build.

A file has three kinds of tables; its first comment is the command that runs it::

    # thundersync run examples/pipeline_fake.toml
    [run]                          # RunSettings: metrics file, progress, default capacity, timeout
    metrics = "metrics.jsonl"

    [objects.scorer]               # a runtime object, built by a factory (app/factories.py)
    factory = "test-fake-scorer"

    [stages.reward]                # a stage: type (stages/REGISTRY), graph fields, Config fields
    type = "reward"
    reads = ["generate"]
    concurrency = 8

Unknown fields, wrong types and unknown stage types fail with a path-qualified
:class:`~thundersync.errors.DefinitionError` (``stages.reward.factr: unknown field; valid
fields: ...``). A stage gets the runtime object named like its keyword argument (``scorer``
above), or the one its ``objects = {scorer = "other"}`` table names. Python code builds the same
:class:`PipelineSpec` directly and passes its own objects::

    spec = PipelineSpec(stages={"reward": StageSpec("reward", RewardStage.Config(), reads=("generate",)), ...})
    graph = build_graph(spec, scorer=MyVerifier())
"""

from __future__ import annotations

import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from thundersync.app._schema import (
    GRAPH_FIELDS,
    convert,
    factory_params,
    object_union,
    runtime_params,
    stage_union,
)
from thundersync.app.factories import ALL_FACTORIES
from thundersync.errors import ConfigError, DefinitionError, GraphError
from thundersync.pipeline.graph import DEFAULT_CAPACITY, INPUT, Graph
from thundersync.pipeline.stage import Stage
from thundersync.stages import REGISTRY
from thundersync.stages.generate import GenerateStage
from thundersync.stages.step import StepStage

__all__ = [
    "ObjectSpec",
    "PipelineSpec",
    "RunSettings",
    "StageSpec",
    "build_graph",
    "build_objects",
    "load",
    "loads",
]


class RunSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How ``thundersync run`` runs the graph.

    ``metrics``: JSONL file for lifecycle events and per-stage statistics (None: none);
    ``progress``: a live stderr line (``auto``: only when stderr is a terminal); ``capacity``:
    inbox size of stages that do not set their own; ``timeout_s``: fail a run that takes longer.
    """

    metrics: str | None = None
    progress: Literal["auto", "on", "off"] = "auto"
    capacity: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_CAPACITY
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None


class ObjectSpec(msgspec.Struct, frozen=True):
    """A runtime object: the name of its factory (``app/factories.py``) and its keyword arguments."""

    factory: str
    args: dict[str, Any] = {}


class StageSpec(msgspec.Struct, frozen=True):
    """A stage: its type in REGISTRY, its Config (None: the defaults) and its place in the graph."""

    type: str
    config: Stage.Config | None = None
    reads: tuple[str, ...] = ()
    capacity: int | None = None
    output: bool = False
    objects: dict[str, str] = {}


class PipelineSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A whole pipeline: stages by name (in order), runtime objects by name, run settings."""

    stages: dict[str, StageSpec]
    objects: dict[str, ObjectSpec] = {}
    run: RunSettings = RunSettings()


class _File(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    stages: dict[str, Any]  # each a table; checked per entry so errors name it
    objects: dict[str, Any] = {}
    run: RunSettings = RunSettings()


# --- reading files -----------------------------------------------------------------------------


def load(path: str | Path) -> PipelineSpec:
    """Read and validate a pipeline file; errors start with the file's path."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DefinitionError(f"{path}: cannot read the pipeline file: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise DefinitionError(f"{path}: the pipeline file is not UTF-8 text: {error}") from None
    try:
        return loads(text)
    except DefinitionError as error:
        raise DefinitionError(f"{path}: {error}") from None


def loads(text: str) -> PipelineSpec:
    """Validate the TOML text of a pipeline file into a :class:`PipelineSpec`."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise DefinitionError(f"not valid TOML: {error}") from None
    top = convert(
        raw, _File, "", fields={"": ["run", "objects", "stages"], ".run": list(RunSettings.__struct_fields__)}
    )
    return PipelineSpec(
        stages={name: _stage(name, table) for name, table in top.stages.items()},
        objects={name: _object(name, table) for name, table in top.objects.items()},
        run=top.run,
    )


def _table(prefix: str, table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise DefinitionError(f"{prefix}: expected a table, got {type(table).__name__} {table!r}")
    return table


def _tag(table: dict[str, Any], kind: str, prefix: str, known: list[str]) -> str | None:
    """The table's ``type``/``factory`` if it is a string; a clear error if it is a list or table."""
    tag = table.get(kind)
    if isinstance(tag, (list, dict)):
        noun = "stage type" if kind == "type" else kind
        raise DefinitionError(f"{prefix}.{kind}: unknown {noun} {tag!r}; known: {', '.join(known)}")
    return tag if isinstance(tag, str) else None


def _stage(name: str, table: Any) -> StageSpec:
    prefix = f"stages.{name}"
    table = _table(prefix, table)
    cls = REGISTRY.get(_tag(table, "type", prefix, list(REGISTRY)) or "")
    fields = None if cls is None else [n for n, *_ in GRAPH_FIELDS] + list(cls.Config.__struct_fields__)
    node = convert(table, stage_union(), prefix, known=list(REGISTRY), fields=fields)
    assert cls is not None  # the tagged union accepted the type
    graph_fields = {n for n, *_ in GRAPH_FIELDS} | {"type"}
    config = convert({k: v for k, v in table.items() if k not in graph_fields}, cls.Config, prefix)
    return StageSpec(
        table["type"], config, reads=node.reads, capacity=node.capacity, output=node.output, objects=dict(node.objects)
    )


def _object(name: str, table: Any) -> ObjectSpec:
    prefix = f"objects.{name}"
    table = _table(prefix, table)
    factory = _tag(table, "factory", prefix, list(ALL_FACTORIES))
    fields = ["factory", *factory_params(factory)] if factory in ALL_FACTORIES else None
    node = convert(table, object_union(), prefix, kind="factory", known=list(ALL_FACTORIES), fields=fields)
    return ObjectSpec(table["factory"], {k: getattr(node, k) for k in table if k != "factory"})


# --- building graphs ---------------------------------------------------------------------------


def build_objects(spec: PipelineSpec, /, **given: Any) -> dict[str, Any]:
    """The runtime objects of ``spec`` by name: ``given`` ones, else built by their factory."""
    objects = dict(given)
    for name, obj in spec.objects.items():
        if name in given:
            continue
        prefix = f"objects.{name}"
        if obj.factory not in ALL_FACTORIES:
            raise DefinitionError(
                f"{prefix}.factory: unknown factory {obj.factory!r}; known: {', '.join(ALL_FACTORIES)}"
            )
        node = convert(
            {"factory": obj.factory, **obj.args},
            object_union(),
            prefix,
            kind="factory",
            known=list(ALL_FACTORIES),
            fields=["factory", *factory_params(obj.factory)],
        )
        try:
            objects[name] = ALL_FACTORIES[obj.factory](**{k: getattr(node, k) for k in obj.args})
        except (TypeError, ValueError) as error:
            raise DefinitionError(f"{prefix}: {obj.factory} failed: {error}") from error
    return objects


def build_graph(spec: PipelineSpec, /, **objects: Any) -> Graph:
    """Build and validate the :class:`Graph` of ``spec``; ``objects`` override ``[objects]`` by name."""
    built = build_objects(spec, **objects)
    graph = Graph()
    for name, node in spec.stages.items():
        graph.add(
            name,
            _make_stage(name, node, built),
            reads=node.reads,
            capacity=node.capacity or spec.run.capacity,
            output=node.output,
        )
    graph.validate()
    _check_required_inputs(graph)
    _check_policy_published(spec, graph)
    return graph


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


def _make_stage(name: str, node: StageSpec, objects: dict[str, Any]) -> Stage:
    prefix = f"stages.{name}"
    cls = REGISTRY.get(node.type)
    if cls is None:
        raise DefinitionError(f"{prefix}.type: unknown stage type {node.type!r}; known: {', '.join(REGISTRY)}")
    params = runtime_params(cls)
    for extra in sorted(set(node.objects) - set(params)):
        raise DefinitionError(
            f"{prefix}.objects.{extra}: a {node.type!r} stage takes no runtime object "
            f"{extra!r}; it takes: {', '.join(params) or 'none'}"
        )
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
    expected = _runtime_class(hint)
    if expected is not None and not isinstance(obj, expected):
        raise DefinitionError(
            f"{prefix}: runtime object {target!r} is a {type(obj).__name__}, but a "
            f"{node.type!r} stage needs a {expected.__name__} for {param!r}"
        )
    return obj


def _runtime_class(hint: Any) -> type | None:
    """The class an object bound to ``hint`` must be an instance of (None: not checkable)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = options[0] if len(options) == 1 else None
    if not isinstance(hint, type):
        return None
    if getattr(hint, "_is_protocol", False) and not getattr(hint, "_is_runtime_protocol", False):
        return None
    return hint
