"""``OpenAITeacher``: OPD teacher log-probs from a vLLM / OpenAI-compatible completions server.

The teacher's log-probs of the student's tokens are the server's *prompt* log-probs: each call
is one ``POST /v1/completions`` whose prompt is ``context_ids + token_ids`` (token ids, never
re-tokenized) with ``echo = true`` and ``logprobs = 1``, and ``max_tokens = 1`` (servers reject 0);
``choices[0].logprobs.token_logprobs`` then holds one log-prob per prompt token (None for the first)
followed by the generated one, and the teacher keeps the entries of ``token_ids``. When the server
echoes the prompt's token ids (vLLM with ``return_token_ids``) they are checked against what was
sent. The request goes through :class:`~thundersync.generation.OpenAIGenerator`'s client, so it
has its retries, backoff and errors. The server batches concurrent requests itself (vLLM's
continuous batching); the teacher stage's ``concurrency`` sets how many are in flight.

vLLM's prompt log-probs come from the raw model distribution (its default ``--logprobs-mode``).
A server without echo log-probs (llama.cpp's, OpenAI's current models) fails the first call
with :class:`~thundersync.errors.BackendCapabilityError`.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from thundersync.errors import BackendCapabilityError
from thundersync.generation.openai_generator import OpenAIGenerator

__all__ = ["OpenAITeacher", "openai_teacher"]


class OpenAITeacher:
    """Teacher log-probs from the server behind ``client`` (use it as ``async with``)."""

    def __init__(self, client: OpenAIGenerator) -> None:
        self.client = client

    async def __aenter__(self) -> OpenAITeacher:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.client.aclose()

    def payload(self, context_ids: list[int], token_ids: list[int]) -> dict[str, Any]:
        """The completions request that scores ``token_ids`` after ``context_ids``."""
        return {
            "model": self.client.model,
            "prompt": [*context_ids, *token_ids],
            "echo": True,
            "logprobs": 1,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }

    async def logprobs(self, context_ids: list[int], token_ids: list[int]) -> list[float]:
        if not context_ids:
            raise ValueError("the teacher needs a non-empty context (the prompt) to score the first token")
        if not token_ids:
            return []
        body = await self.client.post("/v1/completions", self.payload(context_ids, token_ids))  # with its retries
        return self._parse(body, [*context_ids, *token_ids], len(context_ids))

    def _parse(self, body: dict[str, Any], sequence: list[int], start: int) -> list[float]:
        where = f"the server at {self.client._client.base_url} (model {self.client.model!r})"
        choice = (body.get("choices") or [{}])[0]
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and list(echoed) != sequence:
            raise BackendCapabilityError(
                f"{where} echoed prompt token ids that differ from those sent ({len(echoed)} vs {len(sequence)} "
                "tokens): it re-tokenized the prompt, so its log-probs are not the teacher's for these tokens"
            )
        values = (choice.get("logprobs") or {}).get("token_logprobs")
        if values is None or len(values) < len(sequence):
            raise BackendCapabilityError(
                f"{where} returned {0 if values is None else len(values)} log-probs for a prompt of "
                f"{len(sequence)} tokens: the OpenAI teacher needs prompt log-probs (echo=true with logprobs)"
            )
        picked = values[start : len(sequence)]
        if any(value is None for value in picked):
            raise BackendCapabilityError(f"{where} returned no log-prob for some scored tokens: {picked}")
        return [float(value) for value in picked]


def openai_teacher(
    *,
    base_url: str,
    model: str,
    api_key: str | None = None,
    timeout: Annotated[float, msgspec.Meta(gt=0.0)] = 300.0,
    max_retries: Annotated[int, msgspec.Meta(ge=0)] = 5,
) -> OpenAITeacher:
    """The ``openai-teacher`` factory: prompt log-probs of ``model`` at ``base_url``."""
    return OpenAITeacher(OpenAIGenerator(base_url, model, api_key=api_key, timeout=timeout, max_retries=max_retries))
