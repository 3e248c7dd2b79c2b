"""StreamingRun: one model with fixed parameters for one logical batch, and its streamed work.

The run owns what every streaming objective shares: the decoder's anatomy, the trainable
parameters and their flat layout, the scratch that captures one backward's parameter gradients,
the run-wide fp32 (fp64) total that groups add their combined gradient into, and the worker
that executes the GPU work in submission order (off the caller's thread on CUDA by default).

Parameters must not change while a logical batch is open: the run records every trainable
parameter's ``_version`` when the batch's first group opens and :meth:`assert_safe_to_step`
raises if any changed (in-place changes through ``.data`` are invisible to this check). That
call then adds the total into ``p.grad`` (one cast per parameter) and ends the batch.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from thundersync.engine._accum import FlatAccumulator, GradCapture, ParamLayout
from thundersync.engine._worker import Worker
from thundersync.engine.anatomy import DecoderAnatomy, decoder_anatomy
from thundersync.errors import ConfigError, UnknownIdError, UnsafeStepError

__all__ = ["StreamingRun"]

_Group = TypeVar("_Group")


class StreamingRun:
    """Streamed backward execution over ``model`` (a transformers causal LM, optionally peft).

    ``pack_tokens``: ready work is packed into forward/backward passes of up to this many tokens
    (0: every closed trajectory runs alone, as soon as it closes). ``source_offload_device``:
    where the param-sized accumulators live (``"cpu"`` to keep them on the host; results are
    bitwise equal). ``background``: run the work on a worker thread (default: on CUDA only).

    Between a batch's first ``open_group`` and ``assert_safe_to_step()`` leave ``p.grad`` alone
    (the worker briefly points it at its scratch during each backward) and do not change the
    parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pack_tokens: int = 8192,
        source_offload_device: str | torch.device | None = None,
        background: bool | None = None,
    ) -> None:
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
        if pack_tokens < 0:
            raise ConfigError(f"pack_tokens must be >= 0, got {pack_tokens}")
        self.pack_tokens = pack_tokens
        self.layout = ParamLayout(self.params)
        self.accumulator_device = torch.device(source_offload_device) if source_offload_device else self.layout.device
        self.worker = Worker(background=self.layout.device.type == "cuda" if background is None else background)
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._capture: GradCapture | None = None
        self._total: FlatAccumulator | None = None
        self._versions: list[int] | None = None
        self._owner: object | None = None  # the objective whose logical batch is running

    # --- shared resources (worker side) --------------------------------------------------------

    @property
    def capture(self) -> GradCapture:
        """The scratch for one backward's parameter gradients (allocated on first use)."""
        if self._capture is None:
            self._capture = GradCapture(self.layout)
        return self._capture

    def new_accumulator(self) -> FlatAccumulator:
        return FlatAccumulator(self.layout, self.accumulator_device)

    @property
    def total(self) -> FlatAccumulator:
        """The run-wide gradient of J, added into ``p.grad`` by :meth:`assert_safe_to_step`."""
        if self._total is None:
            self._total = self.new_accumulator()
        return self._total

    def tensor(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.layout.device)

    # --- caller side ---------------------------------------------------------------------------

    def submit(self, label: str, job: Callable[[], None]) -> None:
        """Queue GPU work (FIFO); it runs with gradients enabled whatever the caller's mode."""

        def run() -> None:  # inference_mode(False): enable_grad alone cannot lift inference mode
            with torch.inference_mode(False), torch.enable_grad():
                job()

        self.worker.submit(label, run)

    def lookup_group(self, groups: Mapping[Hashable, _Group], group_id: Hashable) -> _Group:
        """An objective's open group ``groups[group_id]``, after raising any failure of queued work."""
        self.worker.raise_if_failed()
        group = groups.get(group_id)
        if group is None:
            raise UnknownIdError(
                f"group {group_id!r} is not open (never opened, or already closed); open_group() it first"
            )
        return group

    def token_ids(self, tokens: Any, what: str) -> list[int]:
        """Validate token ids (a list of ints or a 1-D integer tensor) against the vocabulary."""
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
                raise ConfigError(
                    f"{what} must be a 1-D integer tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}"
                )
            ids = [int(t) for t in tokens.tolist()]
        else:
            try:
                ids = [operator.index(t) for t in tokens]
            except TypeError as error:
                raise ConfigError(f"{what} must be a list of int token ids: {error}") from None
        vocab = self.anatomy.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(
                f"{what} holds token id {bad}, outside the vocabulary of size {vocab} (valid ids: 0..{vocab - 1})"
            )
        return ids

    def prompt_ids(self, group_id: Any, tokens: Any) -> list[int]:
        """Validate a group's prompt: token ids in the vocabulary, at least one of them."""
        prompt = self.token_ids(tokens, f"prompt of group {group_id!r}")
        if not prompt:
            raise ConfigError(f"prompt of group {group_id!r} is empty; a group needs at least one prompt token")
        return prompt

    def turn_ids(self, where: str, tokens: Any, scored: Sequence[bool]) -> tuple[list[int], list[bool]]:
        """Validate a turn of ``where`` (a trajectory): its token ids and one scored flag per token."""
        ids = self.token_ids(tokens, f"turn of {where}")
        flags = [bool(s) for s in scored]
        if len(flags) != len(ids):
            raise ConfigError(
                f"scored has {len(flags)} flags but the turn of {where} has {len(ids)} tokens; give one flag per token"
            )
        return ids, flags

    def begin(self, owner: object) -> None:
        """Start a logical batch of ``owner`` (an objective) if none is running: check the model,
        record parameter versions. One objective at a time: batches of two would mix their sums."""
        self.worker.raise_if_failed()
        if self._owner is not None and self._owner is not owner:
            raise ConfigError(
                f"this StreamingRun is in a logical batch of another objective ({type(self._owner).__name__}); "
                "finish that batch (assert_safe_to_step() or discard()) first, or give each objective its own "
                "StreamingRun"
            )
        self._check_deterministic()
        if self._versions is None:
            self._versions = [p._version for p in self.params]
            self._owner = owner

    def assert_safe_to_step(self, pending: Sequence[str] = ()) -> None:
        """Raise :class:`UnsafeStepError` naming ``pending`` work or moved parameters; else flush.

        Waits for queued work, then adds the run's total into ``p.grad`` and ends the batch. Moved
        parameters end the batch too (its gradients belong to the old values and are dropped).
        """
        if pending:
            raise UnsafeStepError("not safe to step: " + "; ".join(pending))
        self.worker.join()
        moved = self.moved_parameters()
        if moved:
            self.discard()
            shown = ", ".join(moved[:5]) + (f" and {len(moved) - 5} more" if len(moved) > 5 else "")
            raise UnsafeStepError(
                f"not safe to step: trainable parameters were modified in place since the batch began: {shown}; "
                "the streamed gradients belong to the old values and were dropped with the batch: do not change "
                "parameters until assert_safe_to_step() passes"
            )
        if self._total is not None:
            self._total.add_into_grads()
        self._end_batch()

    def discard(self) -> None:
        """Abandon the logical batch: wait for queued work and forget its failure, drop the run's
        total and the recorded parameter versions. The run can start a new batch afterwards."""
        self.worker.clear()
        self._end_batch()

    def _end_batch(self) -> None:
        self._total = None
        self._versions = None
        self._owner = None

    def moved_parameters(self) -> list[str]:
        if self._versions is None:
            return []
        return [self._names.get(id(p), "?") for p, v in zip(self.params, self._versions) if p._version != v]

    def retained_bytes(self) -> int:
        """Bytes of tensors the run itself holds (scratch and total; objectives add theirs)."""
        held = [self._capture, self._total]
        return sum(h.nbytes() for h in held if h is not None)

    def _check_deterministic(self) -> None:
        model = self.anatomy.model
        if not model.training:
            return
        active = [name for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.training and m.p > 0]
        config = getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0
        if active or config > 0:
            what = f"dropout modules {active[:3]}" if active else f"attention_dropout={config}"
            raise ConfigError(
                f"the model is in training mode with active {what}: streamed recomputation must reproduce "
                "the forward exactly; call model.eval() (or set the dropout probabilities to 0)"
            )
