"""StreamingRun: one model with fixed parameters for one logical batch, and its streamed work.

The run owns what every streaming objective shares: the decoder's anatomy, the trainable
parameters and their flat layout, the executor that decides how a pack runs
(:mod:`thundersync.engine.executor`, from the run's :class:`~thundersync.acceleration.Acceleration`),
the sinks a backward sends gradients to (:mod:`thundersync.engine.sinks`: the scratch that
captures one backward's gradients, accumulators, OPD's unscaled sum), the run-wide fp32 (fp64)
total that groups add their combined gradient into, and the worker that executes the GPU work in
submission order (off the caller's thread on CUDA by default, on the run's own CUDA stream:
:mod:`thundersync.engine._streams` says how it is ordered).

Parameters must not change while a logical batch is open: the run's
:class:`~thundersync.engine._guard.ParameterGuard` claims them when the batch's first group
opens (one batch per parameter at a time, across runs), and :meth:`assert_safe_to_step` raises
if any was modified in place or replaced, or if the total is not finite. That call then adds
the total into ``p.grad`` (one cast per parameter) and ends the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from torch import nn

from thundersync._config import build_config
from thundersync._device import upload
from thundersync.acceleration import Acceleration
from thundersync.engine import inputs
from thundersync.engine._guard import ParameterGuard, check_deterministic
from thundersync.engine._streams import JobStream
from thundersync.engine._worker import Worker
from thundersync.engine.executor import PackExecutor
from thundersync.engine.sinks import FlatAccumulator, GradCapture, GradSum, ParamLayout
from thundersync.engine.unscaled import UnscaledSum
from thundersync.errors import ConfigError, UnsafeStepError
from thundersync.model.anatomy import DecoderAnatomy, decoder_anatomy, unwrap_peft

if TYPE_CHECKING:
    from thundersync.engine.distributed import DataParallel

__all__ = ["StreamingRun"]


class StreamingRun:
    """Streamed backward execution over ``model`` (a transformers causal LM, optionally peft).

    Options (:class:`StreamingRun.Config`, or the same names as keywords):
    ``source_offload_device``: where the param-sized accumulators live (``"cpu"`` to keep them
    on the host; results are bitwise equal). ``background``: run the work on a worker thread
    (default: on CUDA only). How work is packed is the objective's option (``pack_tokens``).
    ``acceleration``: the forms its packs may take (:class:`~thundersync.acceleration.Acceleration`,
    resolved once here; default: every field auto, the environment overriding).
    ``data_parallel``: a :class:`~thundersync.engine.distributed.DataParallel` when this run is one
    rank of several; the objectives then reduce their batch statistics (OPD's N) across ranks and
    :class:`~thundersync.StreamingTrainer` sums the gradients before it steps.

    Between a batch's first ``open_group`` and ``assert_safe_to_step()`` leave ``p.grad`` alone
    (the worker briefly points it at its scratch during each backward), and neither change nor
    replace the parameters. One logical batch at a time may stream into a parameter, across
    every run that shares it (:class:`~thundersync.engine._guard.ParameterGuard`).
    """

    class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        """What a pipeline file can set about the run (the model is a runtime object)."""

        source_offload_device: str | None = None
        background: bool | None = None

    def __init__(
        self,
        model: nn.Module,
        config: Config | None = None,
        /,
        *,
        acceleration: Acceleration | None = None,
        data_parallel: DataParallel | None = None,
        **options: Any,
    ) -> None:
        device = options.get("source_offload_device")
        if isinstance(device, torch.device):
            options["source_offload_device"] = str(device)
        self.config = build_config(StreamingRun.Config, config, options, "StreamingRun")
        self.anatomy: DecoderAnatomy = decoder_anatomy(model)
        self.params = self.anatomy.trainable_parameters()
        if not self.params:
            raise ConfigError("the model has no trainable parameter (requires_grad=True); nothing to stream")
        devices = sorted({str(p.device) for p in self.params})
        if len(devices) > 1:
            raise ConfigError(
                f"trainable parameters live on several devices ({', '.join(devices)}); "
                "the streaming engine needs the model on one device"
            )
        self.layout = ParamLayout(self.params)
        self.executor = PackExecutor(self.anatomy, acceleration)
        self.accumulator_device = _device(self.config.source_offload_device) or self.layout.device
        background = self.config.background
        self.worker = Worker(background=self.layout.device.type == "cuda" if background is None else background)
        self.streams = JobStream(self.layout.device, sms=self.executor.acceleration.learner_sms)
        positions = getattr(getattr(unwrap_peft(model), "config", None), "max_position_embeddings", None)
        self.max_positions = int(positions) if positions is not None else None
        self.guard = ParameterGuard(model, self.params)
        self.data_parallel = data_parallel
        self._capture: GradCapture | None = None
        self._total: FlatAccumulator | None = None
        self._owner: object | None = None  # the objective whose logical batch is running

    # --- shared resources (worker side) --------------------------------------------------------

    @property
    def capture(self) -> GradCapture:
        """The scratch for one backward's parameter gradients (allocated on first use)."""
        if self._capture is None:
            self._capture = GradCapture(self.layout)
        return self._capture

    def global_count(self, local: int) -> int:
        """``local`` summed over the data-parallel ranks (itself without ``data_parallel``): every
        rank must call it at the same point of the batch, as for any collective."""
        return local if self.data_parallel is None else self.data_parallel.all_reduce_counts([local])[0]

    def new_accumulator(self) -> FlatAccumulator:
        """A zeroed fp32 (fp64) accumulator over the trainable parameters (a reward-linear pair's half)."""
        return FlatAccumulator(self.layout, self.accumulator_device)

    def unscaled_sum(self) -> UnscaledSum:
        """A sink for a batch's unscaled gradient (OPD's): ``p.grad`` directly for fp32/fp64
        parameters, an fp32 sum (the graph totals drained into it) for 16-bit ones."""
        return UnscaledSum(self.params, self.executor, lambda: GradSum(self.new_accumulator(), self.capture))

    @property
    def total(self) -> FlatAccumulator:
        """The run-wide gradient of J, added into ``p.grad`` by :meth:`assert_safe_to_step`."""
        if self._total is None:
            self._total = self.new_accumulator()
        return self._total

    def tensor(self, ids: Sequence[int]) -> torch.Tensor:
        return upload(torch.tensor(ids, dtype=torch.long), self.layout.device)

    # --- caller side ---------------------------------------------------------------------------

    def submit(self, label: str, job: Callable[[], None]) -> None:
        """Queue GPU work (FIFO); it runs with gradients enabled whatever the caller's mode, on the
        run's side stream (CUDA), after the work the caller's stream holds now."""
        after = self.streams.mark()

        def run() -> None:  # inference_mode(False): enable_grad alone cannot lift inference mode
            with torch.inference_mode(False), torch.enable_grad(), self.streams.running(after):
                job()

        self.worker.submit(label, run)

    def prompt_ids(self, group_id: Hashable, tokens: Any) -> list[int]:
        """Validate a group's id and prompt: token ids in the vocabulary, at least one of them, no
        more than the model has positions for."""
        inputs.check_id(group_id, "group id")
        prompt = inputs.token_ids(tokens, f"prompt of group {group_id!r}", self.anatomy.vocab_size)
        if not prompt:
            raise ConfigError(f"prompt of group {group_id!r} is empty; a group needs at least one prompt token")
        self.check_positions(f"the prompt of group {group_id!r}", len(prompt))
        return prompt

    def turn_ids(self, where: str, tokens: Any, scored: Any) -> tuple[list[int], list[bool]]:
        """Validate a turn of ``where`` (a trajectory): its token ids and one scored flag per token."""
        ids = inputs.token_ids(tokens, f"turn of {where}", self.anatomy.vocab_size)
        return ids, inputs.scored_flags(scored, len(ids), where)

    def check_positions(self, what: str, length: int) -> None:
        """Refuse a sequence of ``length`` tokens past the model's ``max_position_embeddings``."""
        if self.max_positions is not None and length > self.max_positions:
            raise ConfigError(
                f"{what} would be {length} tokens long (prompt included), past the model's "
                f"max_position_embeddings={self.max_positions}; end the trajectory earlier or use a model "
                "with longer positions"
            )

    def wait(self) -> None:
        """Wait for every queued job (raising the first failure); the caller's stream then follows
        the jobs' stream, so what they computed can be read."""
        self.worker.join()
        self.streams.join()

    def begin(self, owner: object) -> None:
        """Start a logical batch of ``owner`` (an objective) if none is running: check the model,
        claim its parameters, record their versions."""
        self.worker.raise_if_failed()
        if self._owner is not None and self._owner is not owner:
            raise ConfigError(
                f"this StreamingRun is in a logical batch of another objective ({type(self._owner).__name__}); "
                "finish that batch (assert_safe_to_step() or discard()) first: two objectives cannot stream into "
                "the same parameters at the same time, whether they share a StreamingRun or not"
            )
        if self._owner is None:
            check_deterministic(self.anatomy.model)
            self.guard.begin(owner)
            self._owner = owner

    @property
    def in_batch(self) -> bool:
        """Whether a logical batch is running: begun, not yet stepped or dropped."""
        return self._owner is not None

    def assert_safe_to_step(self, pending: Sequence[str] = ()) -> None:
        """Raise :class:`UnsafeStepError` naming ``pending`` work, moved or replaced parameters or
        a non-finite gradient; else add the run's total into ``p.grad`` and end the batch.

        Waits for queued work first. Every failure but ``pending`` ends the batch too: its
        gradients are dropped and ``p.grad`` keeps what it held before the batch.
        """
        if pending:
            raise UnsafeStepError("not safe to step: " + "; ".join(pending))
        self.wait()
        problem = self.guard.problem()
        if problem is None and self._total is not None and not self._total.finite():
            problem = self.guard.non_finite(self._total.per_parameter())
        if problem is not None:
            self.discard()
            raise UnsafeStepError(f"not safe to step: {problem}; the batch was dropped")
        if self._total is not None:
            self._total.add_into_grads()
        self._end_batch()

    def discard(self) -> None:
        """Abandon the logical batch: wait for queued work and forget its failure, drop the run's
        total and release the parameters. The run can start a new batch afterwards."""
        self.worker.clear()
        self.streams.join()
        self._end_batch()

    def _end_batch(self) -> None:
        self._total = None
        self._owner = None
        self.guard.end()

    def retained_bytes(self) -> int:
        """Bytes of tensors the run itself holds (scratch and total; objectives add theirs)."""
        held = [self._capture, self._total]
        return sum(h.nbytes() for h in held if h is not None)


def _device(name: str | None) -> torch.device | None:
    if name is None:
        return None
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"source_offload_device {name!r} is not a torch device; use e.g. 'cpu' or 'cuda:0'") from None
