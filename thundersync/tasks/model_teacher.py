"""``TransformersTeacher``: an OPD teacher that is a transformers causal LM in this process.

``logprobs(context_ids, token_ids)`` returns ``log q(token_ids[i] | context_ids + token_ids[:i])``.
Calls that arrive together (the teacher stage scores ``concurrency`` actions at once) are
answered by one forward pass: the first caller waits ``max_wait_s`` for others, then runs up to
``max_batch`` requests in a worker thread, without gradients. A Qwen3/Qwen2/Llama model is scored
by :class:`~thundersync.model.scoring.PackedScorer`: the sequences packed into one run of rows,
replayed from CUDA graphs on a GPU (an eager forward's ~1,400 kernel launches would cost several
times its device time, beside a generator and a learner in one process even more), log-probs from
the fused head kernel. Any other causal LM runs transformers' forward over the batch, left-padded
so that every sequence ends at the same position (positions are counted from each sequence's
first real token, so padding changes nothing), keeping only the logits of the scored tokens
(``logits_to_keep``), the log-softmax in fp32. The model stays on its own
device (give ``device`` to move it there; the teacher may share the learner's GPU or have its own).

The model may be given as a loader (a callable returning it), loaded on first use, so that
building the object (at the start of ``thundersync run``) reads no weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import anyio
import msgspec

from thundersync._device import resolve_device
from thundersync.acceleration import Acceleration
from thundersync.errors import ConfigError
from thundersync.tasks.teacher_path import teacher_directory

if TYPE_CHECKING:  # torch loads when the teacher first scores, so building the teacher stays cheap
    import torch
    from torch import nn

    from thundersync.model.scoring import PackedScorer

__all__ = ["TransformersTeacher", "transformers_teacher"]

_Positive = Annotated[int, msgspec.Meta(ge=1)]


@dataclass(eq=False)
class _Request:
    context: list[int]
    tokens: list[int]
    result: list[float] | None = None
    error: BaseException | None = None


class TransformersTeacher:
    """Teacher log-probs from ``model`` (an ``nn.Module`` returning ``.logits``, or a loader of one)."""

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        *,
        device: str | torch.device | None = None,
        max_batch: int = 16,
        max_wait_s: float = 0.002,
        pad_id: int = 0,
        acceleration: Acceleration | None = None,
    ) -> None:
        if max_batch < 1 or max_wait_s < 0:
            raise ConfigError(f"max_batch must be >= 1 and max_wait_s >= 0, got {max_batch} and {max_wait_s}")
        self._model: nn.Module | None = None
        self._scorer: PackedScorer | Literal[False] | None = None  # False: the model's layout is not supported
        self._load: Callable[[], nn.Module] | None = None
        if hasattr(model, "parameters"):  # an nn.Module (also callable), not a loader
            self._model = cast("nn.Module", model)
        else:
            self._load = model
        self.device = device
        self.acceleration = acceleration  # how its packed scorer runs (resolved when it is built)
        self.max_batch, self.max_wait_s, self.pad_id = max_batch, max_wait_s, pad_id
        self.batches: list[int] = []  # the size of every forward pass so far (how well requests batch)
        self._pending: list[_Request] = []
        self._flushing = False
        self._wake = anyio.Event()

    @property
    def model(self) -> nn.Module:
        """The teacher model on its device, in eval mode (loaded on first use)."""
        if self._model is None:
            assert self._load is not None
            self._model = self._load()
        if self.device is not None:
            self._model.to(self.device)  # once: then the model stays where it is
            self.device = None
        return self._model.eval()

    async def logprobs(self, context_ids: list[int], token_ids: list[int]) -> list[float]:
        if not context_ids:
            raise ValueError("the teacher needs a non-empty context (the prompt) to score the first token")
        if not token_ids:
            return []
        request = _Request(list(context_ids), list(token_ids))
        self._pending.append(request)
        while request.result is None and request.error is None:
            if self._flushing:
                await self._wake.wait()
            else:
                await self._flush()
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    async def _flush(self) -> None:
        """Run the pending requests in batches until none is left; wake their callers."""
        self._flushing = True
        try:
            await anyio.sleep(self.max_wait_s)
            while self._pending:
                batch = self._pending[: self.max_batch]
                del self._pending[: len(batch)]
                try:
                    results = await anyio.to_thread.run_sync(self._forward, batch)
                except Exception as error:
                    for request in batch:
                        request.error = error
                except BaseException:
                    self._pending[:0] = batch  # cancelled: another caller runs them
                    raise
                else:
                    for request, result in zip(batch, results):
                        request.result = result
                self._wake_all()
        finally:
            self._flushing = False
            self._wake_all()

    def _wake_all(self) -> None:
        wake, self._wake = self._wake, anyio.Event()
        wake.set()

    def _forward(self, batch: list[_Request]) -> list[list[float]]:
        """One forward over ``batch`` (in a worker thread): each request's token log-probs."""
        self.batches.append(len(batch))
        scorer = self._packed_scorer()
        if scorer is not None:
            return scorer.logprobs([r.context + r.tokens for r in batch], [len(r.tokens) for r in batch])
        return self._padded_forward(batch)

    def _packed_scorer(self) -> PackedScorer | None:
        if self._scorer is None:
            from thundersync.model.scoring import PackedScorer

            try:
                self._scorer = PackedScorer(self.model, acceleration=self.acceleration)
            except ConfigError:  # not a layout the engine knows: transformers' own forward
                self._scorer = False
        return self._scorer or None

    def _padded_forward(self, batch: list[_Request]) -> list[list[float]]:
        import torch

        model = self.model
        device = next(model.parameters()).device
        sequences = [r.context + r.tokens for r in batch]
        width = max(map(len, sequences))
        keep = max(len(r.tokens) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, width - len(sequence) :] = torch.tensor(sequence)
            mask[row, width - len(sequence) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            out: Any = model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                logits_to_keep=keep + 1,
                use_cache=False,
            )
            logits = out.logits[:, -(keep + 1) : -1].float()  # position t predicts token t + 1
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = ids[:, width - keep :].to(device)
            picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu()
        return [picked[row, keep - len(r.tokens) :].tolist() for row, r in enumerate(batch)]


def transformers_teacher(
    *,
    path: str,
    device: str = "cpu",
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    max_batch: _Positive = 16,
    max_wait_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.002,
    acceleration: Acceleration | None = None,
) -> TransformersTeacher:
    """The ``transformers-teacher`` factory: the causal LM saved at ``path`` (a local directory,
    loaded offline with ``from_pretrained`` on first use) on ``device`` (``cpu``, ``cuda``, ``cuda:N``,
    ``auto``; a file's ``[run] device`` when its table gives none) in ``dtype``. ``path`` may
    also be a training run's checkpoint directory (``runs/agent_grpo``): its newest checkpoint is
    the teacher. ``acceleration``: how it scores (a file's ``[acceleration]`` when not given)."""
    path = str(teacher_directory(Path(path)))

    def load() -> nn.Module:
        import torch
        from transformers import AutoModelForCausalLM

        model: nn.Module = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=getattr(torch, dtype)
        )
        return model

    return TransformersTeacher(
        load, device=resolve_device(device), max_batch=max_batch, max_wait_s=max_wait_s, acceleration=acceleration
    )
