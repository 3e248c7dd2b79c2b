"""A pipeline file's rollout/learner split: ``torchrun --nproc-per-node N -m thundersync run FILE``
with ``[run.split]`` (decisions 088, 090).

Every rank first makes a :class:`~thundersync.engine.split.SplitChannel` over the placement
(:func:`with_channel`), then builds the file's objects and graph as a one-process run would
(:func:`build_split_objects`: no data parallel on rollout ranks, whose models are never sharded;
several learner ranks share the learning over ``channel.learner_group``, their model sharded
there with ``[run] shard = true``, else each holding the whole model with a ``DataParallel`` over
it; a learner rank starts no vLLM engine: its ``vllm-generator`` is an ``UnstartedEngine`` and its
trainer publishes to none, decision 093); then it runs its role's loop instead of the graph
(:func:`run_split`), one batch of the source stage per step:

- a rollout rank takes the graph's stages as settings and objects: the source's batches (group
  ids, prompts, task fields, ``samples`` trajectories per group), the generate stage's
  ``generator``, ``temperature``, ``max_new_tokens`` (cut to what fits the generator's context,
  as the stage does; a prompt that fills the context is refused, where the stage would end the
  trajectory empty), ``stop_token_ids`` and request seeds (CRC-32 of
  ``"{seed}/{group!r}/{trajectory}/0"``, the stage's own), and the reward stage's ``scorer`` (any
  of its three kinds, with the task's fields). It calls
  :func:`~thundersync.split.generate_batch` for each batch (its share of the groups), then
  receives the learner's weights into the model the objective trains, in place. The generator
  samples from them: a ``torch-generator`` over that model directly; a ``vllm-generator``'s
  in-process engine (started in a world of its own) after ``sync_from(model)``, which follows
  every receive, the first (the learner's start) too. Any other generator is refused, as are an
  engine of other shapes than the model and, with ``enable_lora`` and a LoRA model, an adapter
  rank over ``max_lora_rank`` or a base not loaded from the engine's directory (decision 093);
- each learner rank streams its groups of each batch into the backward stage's objective
  (:func:`~thundersync.split.learn_batch`): GRPO's, or OPD's when the file has a teacher-score
  stage, whose ``teacher`` scores each received trajectory on the learner rank (decision 094;
  rollout ranks build the teacher object but never enter or ask it); steps the step stage's
  ``trainer`` (which reduces over the learners), tells its ``checkpointer`` and publishes its
  ``policy`` as the step stage does, gathers the learners' shares of the step metrics, and the
  first learner rank writes the step's line to the metrics file and broadcasts the objective's
  trainable tensors (every parameter, or a LoRA model's adapter only). Before the first batch it
  broadcasts them once (version 0), so the rollout ranks start from its weights. The loop is
  :mod:`thundersync.app.cli.split_learner`'s.

``--resume DIR`` (decision 091): each learner has restored the checkpoint as a one-process run does
(the command's ``_resume``; rollout ranks read none) and counts on from its policy clock's version
k, which its first broadcast carries with the restored tensors; a rollout rank then skips the
source's first k batches (a split steps them in order, one per step), so it samples batch k+1's
groups and seeds on the restored weights. The learner refuses a checkpoint whose consumed batches
are not those k, and any group it receives that is not of the batch it steps. The step stage's
checkpointer writes on the first learner rank (its default writer is rank 0).

The first learner rank alone writes files: the metrics file (``run_started``, one ``step`` line
per step, ``run_finished``; no other lifecycle event), TensorBoard and W&B, and the checkpoints
(a sharded learner's other ranks write their shards into them). A step line has the fields of a
one-process run's over every learner's groups, plus ``groups_per_rank`` (per learner rank);
``rollout_s`` counts from the first learner's wait for the batch (after its previous broadcast)
to the batch's last trajectory it received, and ``generator_idle_s`` is ``null`` (the learners
do not see the generators). Every wait on the channel is bounded by
``THUNDERSYNC_DIST_TIMEOUT_S`` and a rank that dies ends the others with a line naming it and
its role (:mod:`thundersync.engine.split`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from time import perf_counter
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec

from thundersync.app.cli._terminal import printable
from thundersync.app.cli.split_stages import SplitParts
from thundersync.errors import ConfigError, PipelineError
from thundersync.events import PromptSubmitted
from thundersync.generation.base import GenerationRequest, GenerationResult, SamplingParams
from thundersync.grpo.stream import RewardLinearBackward
from thundersync.opd.stream import OPDStream
from thundersync.stages.backward import BackwardStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import AnyScorer, RewardStage, TaskScorer, TrajectoryScorer
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage
from thundersync.stages.teacher import TeacherStage

if TYPE_CHECKING:
    from thundersync.app.cli._terminal import Screen
    from thundersync.app.cli.distributed import Launch
    from thundersync.app.files.definition import SplitSettings
    from thundersync.app.metrics.jsonl import JsonlMetrics
    from thundersync.app.metrics.step_metrics import StepMetrics
    from thundersync.engine.split import SplitChannel
    from thundersync.pipeline.graph import Graph

__all__ = ["SplitParts", "build_split_objects", "run_split", "run_split_rank", "split_parts", "with_channel"]


def split_parts(graph: Graph) -> SplitParts:
    """The split's stages of ``graph``; ConfigError for what the split does not run."""
    stages = {type(node.stage): node.stage for node in graph}
    source, generate, reward = stages.get(SourceStage), stages.get(GenerateStage), stages.get(RewardStage)
    backward, step, scorer = stages.get(BackwardStage), stages.get(StepStage), stages.get(TeacherStage)
    assert isinstance(source, SourceStage) and isinstance(generate, GenerateStage)  # checked when the file was read
    assert isinstance(reward, RewardStage) and isinstance(backward, BackwardStage) and isinstance(step, StepStage)
    if generate.tool_calls is not None:
        raise ConfigError("run.split: the generate stage has a tool_calls parser; a split samples one action per "
                          "trajectory, without tools: drop tool_calls")  # fmt: skip
    objective = backward.objective
    if not isinstance(objective, RewardLinearBackward | OPDStream):
        raise ConfigError(
            f"run.split: the backward stage's objective is a {type(objective).__name__}; the split's learner "
            "streams into a GRPO objective (factory grpo, process = false) or, with a teacher-score stage, an "
            "OPD objective (factory opd, process = false)"
        )
    teacher = scorer.teacher if isinstance(scorer, TeacherStage) else None
    if isinstance(objective, OPDStream) != (teacher is not None):
        has = "a teacher-score stage" if teacher is not None else "no teacher-score stage"
        raise ConfigError(
            f"run.split: the backward stage's objective is a {type(objective).__name__} and the file has {has}; "
            "the learner ranks score with the teacher for OPD alone: give OPD (factory opd) a teacher-score "
            "stage, and GRPO (factory grpo) none"
        )
    _check_generator(generate, objective)
    if step.trainer is None:
        raise ConfigError("run.split: the step stage has no trainer; give it one (factory streaming-trainer)")
    return SplitParts(source, generate, reward, objective, step, teacher)


def _check_generator(generate: GenerateStage, objective: RewardLinearBackward | OPDStream) -> None:
    """The broadcast reaches a rollout rank's model in place (the model the objective trains): a
    ``TorchGenerator`` over that model samples from it, a vLLM engine is made to serve it after
    each receive (``sync_from``, decision 093); any other generator holds weights it never reaches."""
    from thundersync.app.factories.generators import UnstartedEngine
    from thundersync.generation.torch_generator import TorchGenerator
    from thundersync.generation.vllm_generator import VLLMGenerator

    generator, model = generate.generator, objective.run.anatomy.model
    if isinstance(generator, (VLLMGenerator, UnstartedEngine)):
        _check_engine(generator, model)
        return
    if not isinstance(generator, TorchGenerator) or generator._model is not model:
        raise ConfigError(
            f"run.split: the generate stage's generator is a {type(generator).__name__}"
            + ("" if not isinstance(generator, TorchGenerator) else " over another model than the objective's")
            + "; a split's rollout ranks receive the weights into the model the objective trains, so a "
            "torch-generator over that model (model = { object = ... } as the streaming-run's) samples from them, "
            "or a vllm-generator's engine is made to serve them after each receive: use one of these two"
        )


def _check_engine(generator: Any, model: Any) -> None:
    """A vLLM engine's settings fit the model it serves: with ``enable_lora`` and a LoRA model,
    ``sync_from`` moves the adapter alone, over the engine's own base weights (its directory's),
    so the model's base must come from that directory and its rank fit ``max_lora_rank``; else it
    reloads the whole (merged) weights, which fits any model of the directory's architecture."""
    from thundersync.model.anatomy import unwrap_peft

    _check_shapes(generator, model)
    if not generator.enable_lora or unwrap_peft(model) is model:  # no adapter alone to serve
        return
    lora = model.peft_config[model.active_adapter]
    rank = int(getattr(lora, "r", 0))
    if rank > generator.max_lora_rank:
        raise ConfigError(
            f"run.split: the model's LoRA adapter has rank {rank}, over the vllm-generator's max_lora_rank of "
            f"{generator.max_lora_rank}; the engine would refuse the adapter: set max_lora_rank = {rank}"
        )
    base, engine = str(lora.base_model_name_or_path or ""), generator.model
    if not base or not _same_directory(base, engine):
        raise ConfigError(
            f"run.split: the vllm-generator has enable_lora = true, so each rollout rank's engine serves the "
            f"adapter over its own base weights, loaded from {printable(engine)!r}; the model the objective trains "
            f"has another base ({printable(base) or 'built from its config'}): load the model from that directory "
            "(objects.<model>.path), or drop enable_lora (each receive then reloads the merged weights)"
        )


_SHAPES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim")  # fmt: skip


def _check_shapes(generator: Any, model: Any) -> None:
    """A started engine (a rollout rank's) has the model's shapes, so ``sync_from`` can load its weights."""
    from thundersync.app.factories.generators import UnstartedEngine
    from thundersync.model.anatomy import unwrap_peft

    if isinstance(generator, UnstartedEngine):  # a learner's: the rollout ranks check
        return
    ours, theirs = unwrap_peft(model).config, generator.llm.llm_engine.model_config.hf_config
    for field in _SHAPES:
        if getattr(ours, field, None) != getattr(theirs, field, None):
            raise ConfigError(
                f"run.split: the vllm-generator's model {printable(generator.model)!r} has {field} = "
                f"{getattr(theirs, field, None)}, the model the objective trains {getattr(ours, field, None)}; each "
                "receive loads that model's weights into the engine: give both the same shapes (the same model)"
            )


def _same_directory(one: str, other: str) -> bool:
    from pathlib import Path

    try:
        return Path(one).resolve(strict=True) == Path(other).resolve(strict=True)
    except OSError:
        return one == other


async def run_split_rank(
    launched: Launch,
    graph: Graph,
    objects: Mapping[str, Any],
    metrics: JsonlMetrics,
    *,
    screen: Screen,
    timeout_s: float | None,
) -> float:
    """This rank's part of the split (:func:`run_split`) under ``timeout_s`` (run.timeout_s /
    --timeout); says its one summary line; returns the seconds it ran."""
    from thundersync.app.metrics.step_metrics import StepMetrics

    started = perf_counter()
    parts = split_parts(graph)
    channel: SplitChannel = launched.channel  # made before the objects (with_channel)
    placement = channel.placement
    try:
        with anyio.fail_after(timeout_s):
            done = await run_split(channel, parts, objects, metrics, StepMetrics())
    except TimeoutError:
        raise PipelineError(
            f"the run took longer than its timeout of {timeout_s} s (run.timeout_s / --timeout); it was cancelled"
        ) from None
    elapsed = perf_counter() - started
    label = f"thundersync: {launched.label} ({channel.role})"
    if channel.role == "learner" and not launched.writes_files:
        screen.say(
            f"{label}: {done} steps in {elapsed:.1f} s; no files (the first learner, rank {placement.learner[0]}, "
            "writes the metrics and checkpoints)"
        )
    elif channel.role == "learner":
        where = "not written (no --metrics)" if metrics.path is None else printable(str(metrics.path))
        saved = "" if parts.step.checkpointer is None else f"; checkpoints: {printable(str(_directory(parts)))}"
        screen.say(f"{label}: {done} steps in {elapsed:.1f} s; metrics: {where}{saved}")
    else:
        first = "the learner" if len(placement.learner) == 1 else "the first learner"
        screen.say(
            f"{label}: {done} batches generated in {elapsed:.1f} s; no files ({first}, rank "
            f"{placement.learner[0]}, writes the metrics and checkpoints)"
        )
    return elapsed


def with_channel(launched: Launch, split: SplitSettings) -> Launch:
    """``launched`` with the split's :class:`~thundersync.engine.split.SplitChannel` (every rank
    makes it, before the file's objects: a sharded learner shards over its learner group)."""
    import dataclasses

    from thundersync.engine.split import Placement, SplitChannel

    placement = Placement(rollout=tuple(split.rollout), learner=tuple(split.learner))
    channel = SplitChannel(placement, timeout_s=launched.timeout_s, store=launched.store)
    return dataclasses.replace(launched, channel=channel)


def build_split_objects(launched: Launch, spec: Any, build: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """The file's objects on this rank of a split (``build``: :func:`~thundersync.app.files.build.build_objects`).
    A rollout rank's model is never sharded; a learner's is, with ``[run] shard = true`` and
    several learner ranks, over the channel's learner group (``ShardedDataParallel``, FSDP2, as
    the API's), and with ``shard = false`` several learner ranks get a replicated
    ``DataParallel`` over that group (:func:`_attach_learners`). One learner rank holds the whole
    model whatever ``shard`` says, as one process does. A learner rank starts no vLLM engine
    (``START_ENGINES``: its ``vllm-generator`` is an ``UnstartedEngine``, and its trainer publishes
    to none); a rollout rank does, in a world of its own (decision 093)."""
    from thundersync.app.factories.generators import START_ENGINES
    from thundersync.app.factories.training import NO_SHARDING, SHARD_OVER

    channel: SplitChannel = launched.channel
    token = SHARD_OVER.set(channel.learner_group if channel.role == "learner" else NO_SHARDING)
    engines = START_ENGINES.set(channel.role == "rollout")  # a learner never generates: no vLLM engine
    try:
        objects = build(spec)
    finally:
        START_ENGINES.reset(engines)
        SHARD_OVER.reset(token)
    _attach_learners(launched, objects)
    return objects


def _attach_learners(launched: Launch, objects: Mapping[str, Any]) -> None:
    """The learner ranks' reduction: the checkpointers of a sharded model get it (every learner
    writes its shards), several replicated learners get a ``DataParallel`` over the learner group
    (their weights made the first learner's); every checkpointer's writer is the first learner."""
    import datetime

    from thundersync.app.checkpoints.checkpoint import Checkpointer
    from thundersync.app.cli.distributed import _shard_checkpointers
    from thundersync.engine import StreamingRun
    from thundersync.engine.distributed import DataParallel
    from thundersync.engine.sharded import ShardedDataParallel

    channel: SplitChannel = launched.channel
    for obj in objects.values():
        if isinstance(obj, Checkpointer):
            obj.writer = launched.writes_files  # the first learner rank, not rank 0 of the world
    if channel.role != "learner" or len(channel.placement.learner) == 1:
        return
    for obj in objects.values():
        if isinstance(obj, StreamingRun) and isinstance(obj.data_parallel, ShardedDataParallel):
            _shard_checkpointers(objects, obj.data_parallel)
            _refuse_consolidated(objects, obj.data_parallel, channel)
            obj.data_parallel.timeout = datetime.timedelta(seconds=launched.timeout_s)
        elif isinstance(obj, StreamingRun):
            obj.data_parallel = DataParallel(channel.learner_group, store=launched.store, timeout_s=launched.timeout_s)
            obj.data_parallel.broadcast_parameters(obj.params)


def _refuse_consolidated(objects: Mapping[str, Any], sharded: Any, channel: SplitChannel) -> None:
    """torch gathers a sharded model's whole state dict on rank 0 of the world, which is not a
    learner when the split places a rollout rank there: ``consolidated`` is refused then."""
    from thundersync.app.checkpoints.checkpoint import Checkpointer

    for name, obj in objects.items():
        if isinstance(obj, Checkpointer) and obj.sharded is sharded and obj.consolidated and channel.source != 0:
            raise ConfigError(
                f"objects.{name}.consolidated: true, but the split's first learner is rank {channel.source}; torch "
                "gathers a sharded model's whole weights on rank 0 alone: place the learners first (learner = [0, "
                "...]), or drop consolidated (the distributed layout holds the whole model)"
            )


def _directory(parts: SplitParts) -> Any:
    return getattr(parts.step.checkpointer, "directory", "")


async def run_split(
    channel: SplitChannel, parts: SplitParts, objects: Mapping[str, Any], metrics: JsonlMetrics, steps: StepMetrics
) -> int:
    """Run this rank's role to the end of the source's batches; returns the steps taken (learner)
    or the batches generated (rollout). A rollout rank enters the objects that are async context
    managers (engines, graders) for the run, as a one-process run does, except the teacher (an
    OPD file's), which the learner ranks alone enter and ask (decision 094), and the step stage's
    trainer (a rollout rank never steps; its engine serves each broadcast, decision 093)."""
    from thundersync.app.cli.split_learner import learn

    learner = channel.role == "learner"
    skipped = (parts.teacher, parts.step.trainer)
    entered: list[Any] = (
        [parts.teacher] if learner else [obj for obj in objects.values() if all(obj is not s for s in skipped)]
    )
    async with AsyncExitStack() as stack:
        for obj in entered:
            if hasattr(obj, "__aenter__") and hasattr(obj, "__aexit__"):
                await stack.enter_async_context(obj)
        if learner:
            return await learn(channel, parts, metrics, steps)
        return await _generate(channel, parts)


async def _generate(channel: SplitChannel, parts: SplitParts) -> int:
    from thundersync.split import generate_batch

    sampler = _Sampler(parts.generate, parts.reward.scorer)
    version = await _receive(channel, parts)
    parts.source.skip_batches(range(version))  # the learner's step: a resumed run's consumed batches
    batches = 0
    for batch in parts.source.batches():
        sampler.start(batch)
        prompts = [(int(prompt.group_id), list(prompt.prompt_tokens)) for prompt in batch]
        await generate_batch(
            channel, sampler, prompts, group_size=parts.source.config.samples, reward=sampler.reward,
            version=version, params=sampler.params, seed=sampler.seed,
        )  # fmt: skip
        version = await _receive(channel, parts)
        batches += 1
    return batches


async def _receive(channel: SplitChannel, parts: SplitParts) -> int:
    """Receive the learner's next weights into the model (in place; returns their version), and
    make a vLLM engine serve them (``sync_from``: a torch-generator samples from the model itself).
    Every receive, the first too: the learner's start may differ from the engine's directory."""
    from thundersync.generation.vllm_generator import VLLMGenerator

    version = await anyio.to_thread.run_sync(channel.receive_weights, parts.params)
    if isinstance(parts.generate.generator, VLLMGenerator):
        await parts.generate.generator.sync_from(parts.model)
    return version


class _Sampler:
    """The generate stage's sampling and the reward stage's scoring of one request, as the
    :class:`~thundersync.generation.base.Generator` that :func:`generate_batch` calls: it rebuilds
    each request as the stage would (its seed, ``max_new_tokens`` cut to the context), then scores
    the result before returning it; :meth:`reward` hands that score to ``generate_batch``, which
    asks for it right after ``generate`` returns, with no await in between (checked)."""

    def __init__(self, stage: GenerateStage, scorer: AnyScorer) -> None:
        self.stage, self.scorer, self.generator = stage, scorer, stage.generator
        config = stage.config
        self.params = SamplingParams(
            temperature=config.temperature, max_new_tokens=config.max_new_tokens,
            stop_token_ids=tuple(config.stop_token_ids),
        )  # fmt: skip
        self._prompts: dict[int, PromptSubmitted] = {}
        self._requests: dict[int, tuple[int, int]] = {}  # seed -> (group, trajectory)
        self._scored: tuple[list[int], list[int], float] | None = None

    def start(self, batch: Sequence[PromptSubmitted]) -> None:
        self._prompts = {int(prompt.group_id): prompt for prompt in batch}
        self._requests = {}

    def seed(self, group_id: int, trajectory_id: int) -> int:
        """The generate stage's seed of the request (``GenerateStage._request``)."""
        seed = zlib.crc32(f"{self.stage.config.seed}/{group_id!r}/{trajectory_id}/0".encode())
        if self._requests.setdefault(seed, (group_id, trajectory_id)) != (group_id, trajectory_id):
            raise ConfigError(
                f"run.split: trajectory {trajectory_id} of group {group_id} has the same request seed as trajectory "
                f"{self._requests[seed][1]} of group {self._requests[seed][0]}; change stages.generate.seed"
            )
        return seed

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        assert request.params.seed is not None
        group_id, trajectory_id = self._requests[request.params.seed]
        prompt = list(request.prompt_ids)
        limit = self._max_context()
        room = self.params.max_new_tokens if limit is None else min(self.params.max_new_tokens, limit - len(prompt))
        if room < 1:
            raise ConfigError(
                f"run.split: the prompt of group {group_id} has {len(prompt)} tokens, which fill the generator's "
                f"context of {limit}; shorten it or raise the context (a split does not end trajectories early)"
            )
        params = msgspec.structs.replace(request.params, max_new_tokens=room)
        result = await self.generator.generate(msgspec.structs.replace(request, params=params))
        tokens = list(result.token_ids)
        reward = float(await self._score(group_id, trajectory_id, prompt, tokens))
        self._scored = (prompt, tokens, reward)
        return result

    def reward(self, prompt: list[int], tokens: list[int]) -> float:
        scored, self._scored = self._scored, None
        if scored is None or scored[:2] != (prompt, tokens):  # generate_batch asks at once, for the request just done
            raise PipelineError(
                "run.split: split.generate_batch asked for the reward of a request other than the one just "
                "generated; the split's sampler hands over each score as generate returns (decision 088)"
            )
        return scored[2]

    async def _score(self, group_id: int, trajectory_id: int, prompt: list[int], tokens: list[int]) -> float:
        task = self._prompts[group_id].task
        if isinstance(self.scorer, TrajectoryScorer):
            return await self.scorer.score_trajectory(group_id, trajectory_id, prompt, tokens, task)
        if isinstance(self.scorer, TaskScorer):
            return await self.scorer.score_task(prompt, tokens, task)
        return await self.scorer.score(prompt, tokens)

    def _max_context(self) -> int | None:
        """The generate stage's ``max_context_tokens``, else the generator's ``max_seq_len`` (as the stage)."""
        if self.stage.config.max_context_tokens:
            return self.stage.config.max_context_tokens
        known = getattr(self.generator, "max_seq_len", None)
        return known if isinstance(known, int) and not isinstance(known, bool) and known > 0 else None
