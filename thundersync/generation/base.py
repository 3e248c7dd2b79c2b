"""The generation contract shared by every backend: token ids in, token ids and log-probs out.

A backend never re-tokenizes a trajectory: a :class:`GenerationRequest` carries the prompt as token
ids and a :class:`GenerationResult` returns the new token ids, one behaviour log-prob per token and
why generation stopped. Multi-turn agents send the whole sequence again (previous prompt, the
tokens generated so far, then the observation tokens) under the same ``session_id``; a backend
reuses the prefix it already holds instead of recomputing it.

Behaviour log-probs. By default (``logprobs="model"``) the log-prob of a sampled token ``y`` is
taken under the model's own distribution at that position, before temperature, top-k and top-p::

    b(y) = log softmax(z)[y]                       z: the model's logits

This is the quantity a learner recomputes (``log pi(y | context)``), so on-policy it equals the
learner's log-prob. ``logprobs="sampling"`` returns the log-prob under the distribution the token
was actually drawn from instead::

    b(y) = log softmax(mask_{top-k, top-p}(z / T))[y]

Greedy decoding (``temperature=0``) draws from a point mass; its ``"sampling"`` log-prob is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, TypeAlias, runtime_checkable

import anyio
import msgspec

from thundersync.errors import ConfigError
from thundersync.events import TokenId

__all__ = [
    "FinishReason",
    "GeneratesAcrossWeightChanges",
    "GenerationRequest",
    "GenerationResult",
    "Generator",
    "LogprobMode",
    "SamplingParams",
    "allow_weight_changes",
    "generate_many",
]

LogprobMode: TypeAlias = Literal["model", "sampling"]
FinishReason: TypeAlias = Literal["stop", "length"]
"""``"stop"``: a stop token was generated (it is the last returned token); ``"length"``: the
``max_new_tokens`` budget or the backend's sequence capacity was reached."""

_TokenId = TokenId  # [0, 2**31), as the events carry them


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample: ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` switch those off.

    ``seed`` fixes the random draws of one request: with the same seed, prompt and weights a
    backend that supports per-request seeds returns the same tokens whatever else it is batching.
    ``None`` lets the backend choose. ``logprobs`` picks the behaviour log-prob (module docstring).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: LogprobMode = "model"

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # stored as float whatever number was given (0, 1, 0.5)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number, got {value!r}")
            msgspec.structs.force_setattr(self, name, float(value))
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 switches it off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        if self.logprobs not in ("model", "sampling"):
            raise ConfigError(f"logprobs must be 'model' or 'sampling', got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the arg-max token."""
        return self.temperature == 0.0


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One generation call: the full token sequence so far and how to continue it.

    ``session_id`` names a multi-turn sequence: a later request with the same id whose
    ``prompt_ids`` extend what the backend holds reuses that cached prefix.
    """

    prompt_ids: list[_TokenId]
    params: SamplingParams = SamplingParams()
    session_id: int | str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ConfigError("prompt_ids is empty: a request needs at least one prompt token")


class GenerationResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend generated for one request.

    ``token_ids[i]`` was sampled with behaviour log-prob ``logprobs[i]``; ``cached_tokens`` is how
    many prompt tokens were served from a cache instead of being recomputed (0 when unknown).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    prompt_len: int
    cached_tokens: int = 0


@runtime_checkable
class Generator(Protocol):
    """A rollout generation backend: ``await generator.generate(request)``.

    Implementations may serve many concurrent ``generate`` calls at once (continuous batching);
    callers run them in their own task group (see :func:`generate_many`).
    """

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate a continuation of ``request.prompt_ids``."""
        ...


@runtime_checkable
class GeneratesAcrossWeightChanges(Protocol):
    """A backend that can keep generating while the learner's optimizer changes the weights (bounded
    staleness, ``max_staleness >= 1``): a sequence in flight continues on the new weights, and each
    token's behaviour log-prob is the one it was sampled with (partial rollouts, decision 073)."""

    def allow_weight_changes(self) -> None:
        """From now on, let sequences in flight continue across a weight change instead of failing."""
        ...


def allow_weight_changes(generator: Generator, max_staleness: int, owner: str) -> None:
    """Prepare ``generator`` for ``max_staleness >= 1`` (nothing to do at 0), or refuse it with what to do."""
    if max_staleness == 0:
        return
    if not isinstance(generator, GeneratesAcrossWeightChanges):
        raise ConfigError(
            f"{owner} generates up to max_staleness={max_staleness} policy versions ahead of the learner, but its "
            f"generator ({type(generator).__name__}) cannot generate while the weights change (it has no "
            "allow_weight_changes(); a vLLM engine or an OpenAI-compatible server gets each new policy pushed "
            "between batches): use a torch-generator, which shares the learner's weights, or set max_staleness = 0 "
            "on the policy clock"
        )
    generator.allow_weight_changes()


async def generate_many(generator: Generator, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Run all ``requests`` concurrently on ``generator``; results in request order."""
    results: list[GenerationResult | None] = [None] * len(requests)

    async def one(index: int) -> None:
        results[index] = await generator.generate(requests[index])

    async with anyio.create_task_group() as group:
        for index in range(len(requests)):
            group.start_soon(one, index)
    return [r for r in results if r is not None]
