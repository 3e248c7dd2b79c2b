"""The training factories of pipeline files: streaming run, objective, optimizer, schedule, trainer, checkpointer.

Each is a thin wrapper over the library's own classes; the references make the chain::

    [objects.run]          # StreamingRun over the model
    factory = "streaming-run"
    model = { object = "model" }

    [objects.objective]    # RewardLinearBackward (GRPO); "opd" makes an OPDStream
    factory = "grpo"
    run = { object = "run" }
    estimator = "grpo"
    loss = "grpo"          # or "tis", "ppo_decoupled", "gspo": staleness-correcting forms (README)
    process = false        # true: computed in a learner process of its own (LearnerProcess)
    process_env = {}       # that process's extra environment, e.g. { CUDA_MPS_CLIENT_PRIORITY = "1" } under MPS
    process_device = ""    # e.g. "cuda:1": that process computes on its own copy of the parameters there
    # pack_tokens left out: 0 (each trajectory's backward at its close) with [acceleration] learner_sms
    # or a process_device of its own, else 8192 (RewardLinearBackward.Config says when a backward starts)

    [objects.optimizer]    # any torch.optim class over run.params; GRPO maximizes the reward
    factory = "optimizer"
    objective = { object = "objective" }
    name = "AdamW"
    lr = 1e-3
    shard_state = false    # true: ZeRO-1 under torchrun (each rank keeps its part of the state)

    [objects.schedule]     # linear warm-up, then cosine decay to floor_ratio * lr
    factory = "lr-schedule"
    optimizer = { object = "optimizer" }
    warmup_steps = 2
    decay_steps = 20

    [objects.trainer]      # what the step stage calls: clip, step, schedule
    factory = "streaming-trainer"
    objective = { object = "objective" }
    optimizer = { object = "optimizer" }
    schedule = { object = "schedule" }
    max_grad_norm = 1.0
    audit_every = 10       # every 10th step: audit_rel_error, the streamed gradient against a dense one
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from thundersync._logging import get_logger
from thundersync.acceleration import Acceleration
from thundersync.app.checkpoints.checkpoint import Checkpointer, RandomSource
from thundersync.app.factories.generators import UnstartedEngine
from thundersync.engine import StreamingObjective, StreamingRun
from thundersync.engine.objective import Signal
from thundersync.engine.process import LearnerProcess
from thundersync.errors import ConfigError
from thundersync.events import BatchReady
from thundersync.generation.base import Generator
from thundersync.generation.openai_generator import OpenAIGenerator
from thundersync.generation.torch_generator import TorchGenerator
from thundersync.generation.vllm_generator import VLLMGenerator
from thundersync.grpo import RewardLinearBackward
from thundersync.grpo.estimators import Estimator
from thundersync.grpo.losses import KLEstimator, Loss
from thundersync.grpo.stream import default_pack_tokens
from thundersync.opd import Normalization, OPDStream
from thundersync.opd.loss import Advantage
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.step import StepResult, StreamingTrainer

__all__ = [
    "PublishingTrainer",
    "checkpointer",
    "grpo",
    "lr_schedule",
    "opd",
    "optimizer",
    "optimizer_options",
    "schedule_factor",
    "streaming_run",
    "trainer",
]

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_log = get_logger(__name__)


_RUN = StreamingRun.Config()
NO_SHARDING: Any = object()
"""``SHARD_OVER``'s value on a split's rollout rank: its model is never sharded."""
SHARD_OVER: ContextVar[Any] = ContextVar("thundersync_shard_over", default=None)
"""The process group ``[run] shard = true`` shards a ``streaming-run``'s model over: None (the
default) the whole world (data parallel); a split sets its learner group on learner ranks and
``NO_SHARDING`` on rollout ranks while it builds the objects (:mod:`thundersync.app.cli.split`)."""

_GRPO = RewardLinearBackward.Config()  # the objectives' defaults, written once in their Configs
_OPD = OPDStream.Config()


def streaming_run(
    *,
    model: nn.Module,
    source_offload_device: str | None = _RUN.source_offload_device,
    background: bool | None = _RUN.background,
    acceleration: Acceleration | None = None,
    deterministic: bool = False,
    shard: bool = False,
) -> StreamingRun:
    """``streaming-run``: a :class:`~thundersync.engine.StreamingRun` over the model's trainable
    parameters; ``acceleration``: the file's ``[acceleration]`` unless the table gives one;
    ``deterministic`` (the file's ``[run] deterministic`` unless the table gives one): the work
    runs inline, on the caller's thread (``background = false``), so each pack holds what the
    calls alone decide. ``shard`` (the file's ``[run] shard``): with more than one rank, the model
    is sharded first (:class:`~thundersync.engine.sharded.ShardedDataParallel`: rank 0's weights,
    gathered for the batches) and the run streams into the gathered parameters."""
    if deterministic and background:
        raise ConfigError(
            "background = true runs the engine's work on a worker thread, where which items share a pack "
            "depends on timing, but the run is deterministic (run.deterministic = true); drop background "
            "or set run.deterministic = false"
        )
    background = False if deterministic else background
    config = StreamingRun.Config(source_offload_device=source_offload_device, background=background)
    sharded = None
    group = SHARD_OVER.get()  # a split's learner group (None: the world; WORLD_SIZE: no sharding, a rollout rank)
    if shard and _world_size(group) > 1:
        from thundersync.engine.sharded import ShardedDataParallel, rank_bytes

        sharded = ShardedDataParallel(model, group)
        held, whole = rank_bytes(list(sharded.sharded.values())).parameters, rank_bytes(list(model.parameters()))
        _log.info("run sharded", rank=sharded.rank, parameter_bytes=f"{held} of {whole.parameters}")
    elif shard:
        _log.info("run_not_sharded", reason="run.shard = true, but one process holds the whole model")
    return StreamingRun(model, config, acceleration=acceleration, data_parallel=sharded)


def grpo(
    *,
    run: StreamingRun,
    estimator: Estimator = _GRPO.estimator,
    eps: Annotated[float, msgspec.Meta(ge=0)] = _GRPO.eps,
    pack_tokens: _NonNegative | None = _GRPO.pack_tokens,
    stream_early: bool = _GRPO.stream_early,
    tail_groups: _NonNegative = _GRPO.tail_groups,
    loss: Loss = _GRPO.loss,
    tis_cap: Annotated[float, msgspec.Meta(gt=0)] = _GRPO.tis_cap,
    clip_low: Annotated[float, msgspec.Meta(ge=0, lt=1)] = _GRPO.clip_low,
    clip_high: Annotated[float, msgspec.Meta(ge=0)] = _GRPO.clip_high,
    behaviour_cap: Annotated[float, msgspec.Meta(gt=0)] | None = _GRPO.behaviour_cap,
    kl_coef: Annotated[float, msgspec.Meta(ge=0)] = _GRPO.kl_coef,
    kl_estimator: KLEstimator = _GRPO.kl_estimator,
    process: bool = False,
    process_env: dict[str, str] | None = None,
    process_device: str = "",
    deterministic: bool = False,
) -> RewardLinearBackward | LearnerProcess:
    """``grpo``: a :class:`~thundersync.grpo.RewardLinearBackward` (GRPO-family objective) on ``run``,
    with the per-trajectory ``loss`` form and its keys, and ``kl_coef`` > 0 for a KL term to the
    base model of a peft LoRA policy (the file has no separate reference model) (:mod:`thundersync.grpo.losses`);
    ``process = true`` computes it in a learner process of its own (:class:`~thundersync.LearnerProcess`),
    with ``process_env`` in its environment, on ``process_device`` when given (there the loss forms
    work, but the step does not report their importance-weight statistics). ``deterministic`` (the
    file's ``[run] deterministic`` unless the table gives one) refuses ``stream_early``.
    ``pack_tokens`` left out is chosen by placement (:func:`~thundersync.grpo.stream.default_pack_tokens`):
    0, each trajectory's backward at its close, with ``[acceleration] learner_sms`` or a
    ``process_device`` other than the run's device; else 8192."""
    if deterministic and stream_early:
        raise ConfigError(
            "stream_early = true packs branches by whether the engine's worker is idle, which depends on "
            "timing, but the run is deterministic (run.deterministic = true); drop stream_early or set "
            "run.deterministic = false"
        )
    if pack_tokens is None and process and process_device and _device_of(process_device) != run.layout.device:
        pack_tokens = default_pack_tokens(run, own_device=True)  # the child's run cannot know it has a GPU of its own
    build = functools.partial(
        RewardLinearBackward,
        estimator=estimator,
        eps=eps,
        pack_tokens=pack_tokens,
        stream_early=stream_early,
        tail_groups=tail_groups,
        loss=loss,
        tis_cap=tis_cap,
        clip_low=clip_low,
        clip_high=clip_high,
        behaviour_cap=behaviour_cap,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
    )
    return _in_process(run, build, process, process_env, process_device)


def opd(
    *,
    run: StreamingRun,
    normalization: Normalization = _OPD.normalization,
    pack_tokens: _NonNegative = _OPD.pack_tokens,
    advantage: Advantage = _OPD.advantage,
    process: bool = False,
    process_env: dict[str, str] | None = None,
    process_device: str = "",
) -> OPDStream | LearnerProcess:
    """``opd``: an :class:`~thundersync.opd.OPDStream` (on-policy distillation) on ``run``;
    ``advantage = "learner"`` takes each token's reward from the learner's log-prob (decision 082);
    ``process = true`` computes it in a learner process of its own (:class:`~thundersync.LearnerProcess`),
    with ``process_env`` in its environment, on ``process_device`` when given."""
    build = functools.partial(OPDStream, normalization=normalization, pack_tokens=pack_tokens, advantage=advantage)
    return _in_process(run, build, process, process_env, process_device)


_Objective = TypeVar("_Objective", RewardLinearBackward, OPDStream)


def _device_of(name: str) -> torch.device:
    """``name`` as a torch device, ``cuda`` as the current CUDA device (a ConfigError naming it)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"process_device {name!r} is not a torch device; give e.g. 'cuda:1'") from None
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _in_process(
    run: StreamingRun,
    build: Callable[[StreamingRun], _Objective],
    process: bool,
    env: dict[str, str] | None,
    device: str,
) -> _Objective | LearnerProcess:
    """``build(run)``, or the same objective in a child process over the run's model (``process``)
    with ``env`` in its environment, on ``device`` when given."""
    if not process:
        for name, value in (("process_env", env), ("process_device", device)):
            if value:
                raise ConfigError(
                    f"{name} {value!r} is an option of a learner process, and this objective has none: "
                    f"set process = true, or remove {name}"
                )
        return build(run)
    learner = LearnerProcess(run, build, env=env, device=device or None)
    _log.info("learner_process", pid=learner.pid, signal=learner.signal, device=device or str(run.layout.device))
    return learner


def optimizer(
    *, objective: StreamingObjective, name: str, shard_state: bool = False, **options: Any
) -> torch.optim.Optimizer:
    """``optimizer``: the ``torch.optim`` class ``name`` over ``objective.run.params``, with ``options``
    as its keyword arguments (``lr = 1e-3``, ``weight_decay = 0.0``...).

    A GRPO objective (reward signal) is maximized: ``maximize = True`` is set for it (the streamed
    gradient is that of the reward); an OPD objective (a loss) is minimized.

    ``shard_state = true`` shards the optimizer's state over the ranks of a data-parallel launch
    (ZeRO-1: ``torch.distributed.optim.ZeroRedundancyOptimizer`` over the class ``name``; each
    rank keeps the state of its part of the parameters, steps that part and broadcasts it). With
    one process there is nothing to shard: the optimizer is the plain one.
    """
    cls, options = optimizer_options(name, options, objective.signal)
    params = objective.run.params
    if _sharded(objective.run):
        if shard_state:
            raise ConfigError(
                "shard_state = true shards the optimizer's state with ZeRO-1, but the run is sharded already "
                "([run] shard = true: each rank's optimizer holds its shard's state); drop shard_state"
            )
        params = objective.run.data_parallel.parameters()  # type: ignore[union-attr]  # checked by _sharded
    if shard_state:
        if _world_size() > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            sharded = ZeroRedundancyOptimizer(params, optimizer_class=cls, **options)
            here = sum(len(group["params"]) for group in sharded.optim.param_groups)
            _log.info("optimizer_sharded", rank=sharded.rank, parameters=f"{here} of {len(params)}")
            return sharded
        _log.info("optimizer_not_sharded", reason="shard_state = true, but one process holds all the state")
    built: torch.optim.Optimizer = cls(params, **options)
    return built


def _sharded(run: StreamingRun) -> bool:
    """Whether ``run`` streams into a sharded model (its optimizer steps the shards)."""
    from thundersync.engine.sharded import ShardedDataParallel

    return isinstance(run.data_parallel, ShardedDataParallel)


def _world_size(group: Any = None) -> int:
    """The ranks of the default process group (1 without one), or of ``group`` (``SHARD_OVER``'s
    value: a process group, or ``NO_SHARDING``, which counts as one rank)."""
    import torch.distributed as dist

    if group is NO_SHARDING:
        return 1
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def optimizer_options(
    name: str, options: Mapping[str, Any], signal: Signal | None
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The ``torch.optim`` class ``name`` and the keyword arguments to build it with, checked
    without building it (``thundersync check`` calls this): the class exists, it takes every
    option and is given every option it needs, and ``maximize`` suits the objective's ``signal``
    (None: not known). Errors start with the field they are about."""
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or name == "Optimizer":
        valid = {
            n for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
        }
        raise ConfigError(
            f"name: unknown torch.optim optimizer {name!r}; valid: {', '.join(sorted(valid - {'Optimizer'}))}"
        )
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name not in ("self", "params")]
    accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [] if any(p.kind is p.VAR_KEYWORD for p in params) else sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"{unknown[0]}: {name} takes no option(s) {', '.join(unknown)}; its options: {', '.join(accepted)}"
        )
    needed = [p.name for p in params if p.name in accepted and p.default is p.empty and p.name not in options]
    if needed:
        raise ConfigError(f"{needed[0]}: {name} needs option(s) {', '.join(needed)}; give them, e.g. {needed[0]} = ...")
    if signal is None:
        return cls, dict(options)
    maximize = signal == "reward"
    if "maximize" in options and options["maximize"] != maximize:
        raise ConfigError(
            f"maximize: maximize = {options['maximize']} would train the {signal} objective the wrong way; "
            "drop it (GRPO maximizes the reward, OPD minimizes its loss)"
        )
    if maximize and "maximize" not in accepted:
        raise ConfigError(f"name: {name} cannot maximize (no maximize option), which GRPO needs; choose e.g. AdamW")
    return cls, {**options, "maximize": True} if maximize else dict(options)


def schedule_factor(step: int, *, warmup_steps: int, decay_steps: int, floor_ratio: float) -> float:
    """The learning-rate multiplier after ``step`` scheduler steps: linear warm-up over
    ``warmup_steps`` (``(step + 1) / warmup_steps``), then a cosine from 1 down to ``floor_ratio``
    over ``decay_steps`` (0: constant), then ``floor_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_steps == 0:
        return 1.0
    progress = min(step - warmup_steps, decay_steps) / decay_steps
    return floor_ratio + (1.0 - floor_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_schedule(
    *,
    optimizer: torch.optim.Optimizer,
    warmup_steps: _NonNegative = 0,
    decay_steps: _NonNegative = 0,
    floor_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0,
) -> LRScheduler:
    """``lr-schedule``: a ``torch.optim.lr_scheduler.LambdaLR`` of :func:`schedule_factor`; the
    trainer steps it after each optimizer step."""
    return LambdaLR(
        optimizer,
        lambda step: schedule_factor(step, warmup_steps=warmup_steps, decay_steps=decay_steps, floor_ratio=floor_ratio),
    )


def trainer(
    *,
    objective: StreamingObjective,
    optimizer: torch.optim.Optimizer,
    schedule: LRScheduler | None = None,
    max_grad_norm: Annotated[float, msgspec.Meta(gt=0)] | None = None,
    generator: Generator | None = None,
    policy: PolicyClock | None = None,
    audit_every: _NonNegative = 0,
) -> StreamingTrainer:
    """``streaming-trainer``: a :class:`~thundersync.stages.step.StreamingTrainer` that clips the
    gradient norm to ``max_grad_norm`` (unset: no clipping), steps ``optimizer``, then ``schedule``;
    every ``audit_every``-th step (0: never) it also recomputes the batch's gradient densely and
    reports the streamed one's relative error (``audit_rel_error`` in the metrics). Given a ``generator`` that does not share the model's weights, it then publishes the policy
    to it (:class:`PublishingTrainer`); ``policy``, the step stage's clock, numbers the versions. A
    split's learner rank has no engine to publish to (its ``vllm-generator`` is an
    :class:`~thundersync.app.factories.generators.UnstartedEngine`; the split broadcasts the weights)."""
    if audit_every and _sharded(objective.run):
        raise ConfigError(
            f"audit_every = {audit_every}: the audit recomputes the gradient through the model's own forward, "
            "which on a sharded model ([run] shard = true) runs FSDP's hooks; set audit_every = 0 or run.shard = false"
        )
    if generator is None or isinstance(generator, (TorchGenerator, UnstartedEngine)):  # shares them, or no engine
        return StreamingTrainer(
            objective, optimizer, max_grad_norm=max_grad_norm, scheduler=schedule, audit_every=audit_every
        )
    return PublishingTrainer(
        objective,
        optimizer,
        generator=generator,
        policy=policy,
        max_grad_norm=max_grad_norm,
        scheduler=schedule,
        audit_every=audit_every,
    )


class PublishingTrainer(StreamingTrainer):
    """A :class:`StreamingTrainer` that publishes the policy to ``generator`` after each optimizer
    step, before the step stage announces it: an in-process vLLM engine syncs the weights
    (``VLLMGenerator.sync_from``), an OpenAI server takes them by its publish route
    (``OpenAIGenerator.publish``). The version is the one the step stage publishes next
    (``policy.version + 1``; without a clock, the count of this trainer's steps).

    Entered as an async context manager before the run's first batch (``thundersync run`` enters
    every object that is one, after the generator it holds), it publishes the policy the model
    holds then, as version ``policy.version`` (0, or a resumed run's step): the generator was
    started from its own weights (a vLLM engine from its directory), which need not be the
    model's (a resumed checkpoint, a warm-up, an adapter whose initial update is not zero)."""

    def __init__(
        self,
        objective: StreamingObjective,
        optimizer: torch.optim.Optimizer,
        *,
        generator: Generator,
        policy: PolicyClock | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(generator, (OpenAIGenerator, VLLMGenerator)):
            raise ConfigError(
                f"the trainer cannot publish weights to a {type(generator).__name__}; give it a vllm-generator or "
                "an openai-generator (a torch-generator shares the weights and needs none)"
            )
        super().__init__(objective, optimizer, **options)
        self.generator, self.policy, self.published = generator, policy, 0

    async def __aenter__(self) -> PublishingTrainer:
        await self._publish(self._version())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None

    async def step(self, ready: BatchReady) -> StepResult:
        result = await super().step(ready)  # the optimizer has stepped: the weights are final
        await self._publish(self._version() + 1)
        return result

    def _version(self) -> int:
        """The version the generator serves now (the clock's; without one, this trainer's count)."""
        return self.policy.version if self.policy is not None else self.published

    async def _publish(self, version: int) -> None:
        model = self.objective.run.anatomy.model
        if isinstance(self.generator, OpenAIGenerator):
            await self.generator.publish(model, version)
        else:
            await self.generator.sync_from(model)
        self.published = version


def checkpointer(
    *,
    directory: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: PolicyClock,
    every: _NonNegative = 0,
    keep_last: Annotated[int, msgspec.Meta(ge=1)] = 2,
    keep_every: _NonNegative = 0,
    schedule: LRScheduler | None = None,
    generator: RandomSource | None = None,
    rngs: dict[str, RandomSource] | None = None,
    shard: bool = False,
    consolidated: bool = False,
) -> Checkpointer:
    """``checkpointer``: a :class:`~thundersync.app.checkpoints.checkpoint.Checkpointer` in ``directory``, so
    that ``thundersync run FILE --resume DIR`` continues a run. ``generator``: the generator whose
    random state is saved with it (a ``torch-generator``); ``rngs``: more objects with a random
    state, by name (``rngs = { teacher = { object = "teacher" } }``). Give it to the step stage
    (``objects = { checkpointer = "NAME" }``, or name the object ``checkpointer``); the graph's
    source stage, when it has exactly one, is its data position. Retention: of the run's own
    checkpoints the ``keep_last`` newest (the final one always) and those whose step is a multiple
    of ``keep_every`` (0: none) are kept. ``shard`` (the file's ``[run] shard``): the distributed
    layout, every rank writing its shards through ``torch.distributed.checkpoint`` (one process
    writes the whole state in it), resumable on another number of ranks; ``consolidated = true``
    adds the whole model (or adapter) as safetensors, written by rank 0."""
    if generator is not None and rngs is not None and "generator" in rngs:
        raise ConfigError(
            "generator and rngs.generator both name a random state 'generator'; give it once "
            "(rngs = { generator = ... } alone, or generator = ...)"
        )
    rngs = {**({"generator": generator} if generator is not None else {}), **(rngs or {})}
    return Checkpointer(
        Path(directory),
        model=model,
        optimizer=optimizer,
        policy=policy,
        every=every,
        keep_last=keep_last,
        keep_every=keep_every,
        scheduler=schedule,
        rngs=rngs,
        distributed=shard,
        consolidated=consolidated,
    )
