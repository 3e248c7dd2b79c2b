"""Pipeline definition files: TOML decoded straight into msgspec Structs (:class:`PipelineSpec`).

A file has three kinds of tables; its first comment is the command that runs it::

    # thundersync run examples/pipeline_fake.toml
    [run]                          # RunSettings: device, metrics file, TensorBoard, progress, capacity, timeout, steps
    metrics = "metrics.jsonl"
    device = "cpu"                 # every object that takes a device and gives none (default "auto")

    [objects.scorer]               # a runtime object, built by a factory (app/factories/registry.py)
    factory = "test-fake-scorer"

    [objects.run]                  # a field that takes an object references it by name
    factory = "streaming-run"
    model = { object = "model" }

    [stages.reward]                # a stage: type (stages/REGISTRY), graph fields, Config fields
    type = "reward"
    reads = ["generate", "tool-execute"]
    concurrency = 8

An optional fourth, ``[eval]`` (:class:`EvalSettings`), evaluates the policy on a held-out set
every N steps and at the end (:mod:`thundersync.app.evaluation`).

A stage that closes a loop names the loop's edge back to it in ``feedback`` instead of ``reads``
(``feedback = ["tool-execute"]`` on the generate stage of an agent loop); any other cycle fails
with a path-qualified error naming it.

A reference is a table with the single key ``object``; it is allowed on a factory's parameters
whose type is not plain data (a model, an optimizer, a tokenizer...), and required there when the
parameter has no default. It may also sit inside the tables and arrays of such a parameter's value
(``rngs = { generator = { object = "generator" } }``, ``tools = [{ object = "calc" }]``) or of a
free-form one (``dict[str, Any]``, a factory's ``**options``); each is replaced by its object when
the factory is called. Objects are built in dependency order (:mod:`thundersync.app.files.object_graph`).

Unknown fields, wrong types and unknown stage types fail with a path-qualified
:class:`~thundersync.errors.DefinitionError` (``stages.reward.factr: unknown field; valid
fields: ...``), and so does a file that nests tables and arrays more than :data:`MAX_NESTING`
levels deep. :func:`~thundersync.app.files.build.build_graph` turns a spec into a graph; Python code
builds the same :class:`PipelineSpec` directly.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from thundersync._device import check_device
from thundersync.acceleration import Acceleration
from thundersync.app.factories.registry import ALL_FACTORIES
from thundersync.app.files._schema import (
    GRAPH_FIELDS,
    convert,
    factory_params,
    factory_table,
    reference_params,
    stage_union,
    takes_extra_options,
)
from thundersync.app.files.overrides import apply_overrides
from thundersync.app.files.split import SplitSettings, check_split
from thundersync.app.metrics.wandb import WandbSettings
from thundersync.errors import ConfigError, DefinitionError
from thundersync.pipeline.graph import DEFAULT_CAPACITY
from thundersync.pipeline.stage import Stage
from thundersync.stages import REGISTRY

__all__ = [
    "MAX_NESTING",
    "EvalSettings",
    "ObjectSpec",
    "PipelineSpec",
    "RunSettings",
    "SplitSettings",
    "StageSpec",
    "is_reference",
    "load",
    "loads",
    "references",
]

MAX_NESTING: Final = 32
"""How deep a pipeline file may nest tables and arrays (the file itself is level 1). Real files
need four or five levels; the limit keeps a hostile file from exhausting the parser's stack."""


class RunSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How ``thundersync run`` runs the graph.

    ``metrics``: JSONL file for lifecycle events and per-stage statistics (None: none);
    ``progress``: a live stderr line (``auto``: only when stderr is a terminal); ``capacity``:
    inbox size of stages that do not set their own; ``timeout_s``: fail a run that takes longer;
    ``steps``: stop after this many optimizer steps (the graph's one source stage emits that many
    batches, repeating its tasks epoch after epoch as needed, so ``steps`` wins over its
    ``repeat``; None: the source's ``repeat`` epochs decide); ``device``: the device of every
    object whose factory takes a ``device`` and whose table gives none (``cpu``, ``cuda``,
    ``cuda:N``, or ``auto``: the GPU when there is one); ``tensorboard``: a directory for
    TensorBoard scalars of each step line (:mod:`thundersync.app.metrics.tensorboard`; None: none);
    ``wandb``: a W&B run of the same records (``[run.wandb]``: :mod:`thundersync.app.metrics.wandb`);
    ``threads``: torch's CPU threads for the whole run (``torch.set_num_threads``; None: the
    default of :mod:`thundersync.app.cli.threads`).
    ``max_staleness``: how many policy versions generation may run ahead of the learner, given to
    every object whose factory takes ``max_staleness`` (``policy-clock``) and whose table gives none
    (None: each clock's own, whose default is 0; README "Bounded staleness", decision 073).
    ``deterministic``: two runs of the same file, and a run resumed from a checkpoint against the
    uninterrupted one, end with bitwise equal parameters and metrics on CPU in one process (same
    machine, torch build and thread count; not data-parallel launches, no promise on CUDA), at the cost of the overlap: it reaches every
    object whose factory takes ``deterministic`` (``streaming-run``: inline work; ``grpo``: no
    ``stream_early``; ``torch-generator``: one request at a time, no cached prefixes;
    ``transformers-teacher``: one request per forward) and every backward stage (``ordered``:
    whole groups in opening order, without ``all_groups_opened``)
    (docs/decisions/070-fp64-throughout-and-deterministic-runs.md).
    ``shard``: under a data-parallel launch (``torchrun``), every streaming run's model is sharded
    over the ranks (FSDP2: :class:`~thundersync.engine.sharded.ShardedDataParallel`) and the
    optimizer steps each rank's shard; one process has nothing to shard and ignores it
    (docs/decisions/075-sharded-learner-gathers-once-per-batch.md); under ``[run.split]``, over
    the learner ranks when there are several (a single learner rank holds the whole model; decision
    090). A ``checkpointer`` takes it too:
    its checkpoints are then in the distributed layout (every rank writes its shards; one process
    writes that layout as well), resumable on another number of ranks (decision 083).
    ``split``: a rollout/learner split of a multi-process launch (``[run.split]``,
    :class:`SplitSettings`; None: data parallel, every rank generates and learns).
    """

    metrics: str | None = None
    tensorboard: str | None = None
    wandb: WandbSettings | None = None
    progress: Literal["auto", "on", "off"] = "auto"
    capacity: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_CAPACITY
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    steps: Annotated[int, msgspec.Meta(ge=1)] | None = None
    device: str = "auto"
    threads: Annotated[int, msgspec.Meta(ge=1)] | None = None
    deterministic: bool = False
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] | None = None
    shard: bool = False
    split: SplitSettings | None = None


class EvalSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``[eval]``: evaluation runs on a held-out set (:mod:`thundersync.app.evaluation`).

    ``tasks``: the name of the tasks object of the held-out set; ``every``: evaluate after every
    N-th optimizer step (0: never during the run); ``at_end``: and after the last step;
    ``samples``: samples per task (n of pass@k), ``k``: pass@k's k (default ``samples``);
    ``temperature``: 0 is greedy; ``max_new_tokens``: per action (default: the rollout stage's);
    ``pass_threshold``: a sample passes when its reward is at least this; ``stage``: the rollout
    stage (``generate`` or ``agent-app``) whose generator, tools and app are used (default: the
    file's only one); ``scorer``: the name of the reward object (default: the reward stage's).
    """

    tasks: str
    every: Annotated[int, msgspec.Meta(ge=0)] = 0
    at_end: bool = True
    samples: Annotated[int, msgspec.Meta(ge=1)] = 1
    k: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    pass_threshold: float = 1.0
    stage: str | None = None
    scorer: str | None = None


class ObjectSpec(msgspec.Struct, frozen=True):
    """A runtime object: the name of its factory (``app/factories/registry.py``), its keyword arguments
    given as values (``args``) and those given as references to other objects (``refs``: the
    reference's path in the table -> object name). A reference that is a whole argument has its
    parameter as path (``"model"``) and is not in ``args``; one nested inside an argument's tables
    and arrays has a longer path (``"rngs.generator"``, ``"tools[0]"``) and stays in place, as its
    ``{ object = "NAME" }`` table, in that argument's value."""

    factory: str
    args: dict[str, Any] = {}
    refs: dict[str, str] = {}


class StageSpec(msgspec.Struct, frozen=True):
    """A stage: its type in REGISTRY, its Config (None: the defaults) and its place in the graph
    (``reads``: forward edges; ``feedback``: edges that close a loop, see ``Graph.add``)."""

    type: str
    config: Stage.Config | None = None
    reads: tuple[str, ...] = ()
    feedback: tuple[str, ...] = ()
    capacity: int | None = None
    output: bool = False
    objects: dict[str, str] = {}


class PipelineSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A whole pipeline: stages by name (in order), runtime objects by name, run settings, and how
    the run, the generator and the teacher compute (``[acceleration]``: every object whose factory
    takes an ``acceleration`` gets it, resolved once, when its table gives none)."""

    stages: dict[str, StageSpec]
    objects: dict[str, ObjectSpec] = {}
    run: RunSettings = RunSettings()
    acceleration: Acceleration = Acceleration()
    eval: EvalSettings | None = None


class _File(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    stages: dict[str, Any]  # each a table; checked per entry so errors name it
    objects: dict[str, Any] = {}
    run: RunSettings = RunSettings()
    acceleration: Acceleration = Acceleration()
    eval: EvalSettings | None = None


# --- reading files -----------------------------------------------------------------------------


def load(path: str | Path, overrides: Sequence[str] = ()) -> PipelineSpec:
    """Read and validate a pipeline file, with ``--set`` ``overrides`` applied (``app/files/overrides.py``);
    errors start with the file's path."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DefinitionError(f"{path}: cannot read the pipeline file: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise DefinitionError(f"{path}: the pipeline file is not UTF-8 text: {error}") from None
    try:
        return loads(text, overrides)
    except DefinitionError as error:
        raise DefinitionError(f"{path}: {error}") from None


def loads(text: str, overrides: Sequence[str] = ()) -> PipelineSpec:
    """Validate the TOML text of a pipeline file, with ``overrides`` applied, into a :class:`PipelineSpec`."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise DefinitionError(f"not valid TOML: {error}") from None
    except RecursionError:  # tomllib recurses once per level; a few hundred levels exhaust the stack
        raw = None
    if raw is None or _nesting(raw) > MAX_NESTING:
        raise DefinitionError(
            f"the file nests tables and arrays more than {MAX_NESTING} levels deep; pipeline files "
            "need only a few levels, so flatten the deepest value"
        )
    apply_overrides(raw, overrides)
    fields = {
        "": ["run", "objects", "stages", "acceleration", "eval"],
        ".run": list(RunSettings.__struct_fields__),
        ".run.wandb": list(WandbSettings.__struct_fields__),
        ".run.split": list(SplitSettings.__struct_fields__),
        ".acceleration": list(Acceleration.__struct_fields__),
        ".eval": list(EvalSettings.__struct_fields__),
    }
    top = convert(raw, _File, "", fields=fields)
    _check_device("run.device", top.run.device)
    spec = PipelineSpec(
        stages={name: _stage(name, table) for name, table in top.stages.items()},
        objects={name: _object(name, table) for name, table in top.objects.items()},
        run=top.run,
        acceleration=top.acceleration,
        eval=top.eval,
    )
    check_split(spec)
    return spec


def _nesting(value: Any) -> int:
    """How many levels of tables (dicts) and arrays (lists) ``value`` nests, counted without recursion."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_NESTING:
            break
        pending.extend((child, level + 1) for child in children)
    return deepest


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
        table["type"],
        config,
        reads=node.reads,
        feedback=node.feedback,
        capacity=node.capacity,
        output=node.output,
        objects=dict(node.objects),
    )


def _object(name: str, table: Any) -> ObjectSpec:
    prefix = f"objects.{name}"
    table = _table(prefix, table)
    factory = _tag(table, "factory", prefix, list(ALL_FACTORIES))
    refs = dict(references(prefix, {k: v for k, v in table.items() if k != "factory"}))
    whole = {key for key in refs if key in table}  # references that are a whole argument
    takes = reference_params(factory) if factory in ALL_FACTORIES else {}
    nested = {key.split(".")[0].split("[")[0] for key in refs if key not in whole} & set(takes)
    values = {key: value for key, value in table.items() if key not in whole and key not in nested}
    fields = ["factory", *factory_params(factory), *takes] if factory in ALL_FACTORIES else None
    node = factory_table(values, prefix, fields)
    assert factory is not None and fields is not None  # the tagged union accepted the factory
    _check_references(prefix, factory, {key: refs[key] for key in whole}, fields)
    if "device" in factory_params(factory) and "device" in values:
        _check_device(f"{prefix}.device", values["device"])
    args = {k: getattr(node, k) if k in node.__struct_fields__ else v for k, v in values.items() if k != "factory"}
    return ObjectSpec(factory, {**args, **{key: table[key] for key in nested}}, refs)


def _check_device(path: str, value: object) -> None:
    try:
        check_device(value)
    except ConfigError as error:
        raise DefinitionError(f"{path}: {error}") from None


def references(prefix: str, value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """``(path, object name)`` of every reference in ``value``, at any depth of its tables and
    arrays (``model``, ``rngs.generator``, ``tools[0]``); ``prefix`` starts error messages."""
    if is_reference(value):
        yield path, _reference(f"{prefix}.{path}", value)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from references(prefix, item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from references(prefix, item, f"{path}[{index}]")


def is_reference(value: Any) -> bool:
    """Whether ``value`` is a reference table, ``{ object = "NAME" }``."""
    return isinstance(value, dict) and set(value) == {"object"}


def _reference(path: str, value: dict[str, Any]) -> str:
    target = value["object"]
    if not isinstance(target, str) or not target:
        raise DefinitionError(
            f'{path}.object: a reference names an object, e.g. {{ object = "model" }}; got {target!r}'
        )
    return target


def _check_references(prefix: str, factory: str, refs: dict[str, str], fields: list[str]) -> None:
    """References only on parameters that take objects; every required one given."""
    takes = reference_params(factory)
    for key in refs:
        if key in takes or (key not in fields and takes_extra_options(factory)):
            continue
        if key in fields:
            raise DefinitionError(f"{prefix}.{key}: takes a value, not a reference to an object")
        raise DefinitionError(f"{prefix}.{key}: unknown field; valid fields: {', '.join(fields)}")
    for key, (_, required) in takes.items():
        if required and key not in refs:
            raise DefinitionError(
                f'{prefix}.{key}: missing required field (a reference to another object: {key} = {{ object = "NAME" }})'
            )
