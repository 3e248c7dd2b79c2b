"""``OpenAIGenerator``: an async client for any OpenAI-compatible completions server.

Built for vLLM's server (``python -m vllm.entrypoints.openai.api_server``): the prompt is sent as
token ids, and ``return_token_ids`` brings the generated token ids back, so a trajectory is never
re-tokenized. A server that does not return token ids fails the request with
:class:`~thundersync.errors.BackendCapabilityError` instead of silently re-tokenizing text.

Each request is one ``POST {base_url}/v1/completions`` with ``logprobs=1``: the sampled token's
log-prob is the behaviour log-prob. Which distribution it comes from is the server's choice
(vLLM's ``--logprobs-mode``; its default ``raw_logprobs`` is this library's ``"model"``): declare
it with ``logprobs=``. vLLM's extensions ``top_k``, ``stop_token_ids`` and ``ignore_eos`` carry
the rest of :class:`SamplingParams` (the model's end-of-sequence token stops generation only when
it is listed in ``stop_token_ids``).

Transient failures (connection errors, timeouts, HTTP 408/429/500/502/503/504) are retried with
exponential backoff, ``min(max_backoff, backoff * 2**attempt)`` seconds times a random factor in
[0.5, 1], up to ``max_retries`` times; other HTTP errors fail at once with the server's message.

The server does not share the learner's weights: :meth:`OpenAIGenerator.publish` hands it each new
policy, through vLLM's LoRA-adapter route, its dev-mode in-place reload, or a hook
(``publish=``; :mod:`thundersync.generation.publish` says what each needs of the server).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from thundersync._logging import get_logger
from thundersync.errors import BackendCapabilityError, ConfigError, GenerationError, MissingExtraError
from thundersync.generation.base import GenerationRequest, GenerationResult, LogprobMode
from thundersync.generation.publish import Publisher, PublishHook, PublishRoute

if TYPE_CHECKING:
    from torch import nn

__all__ = ["OpenAIGenerator"]

_log = get_logger(__name__)
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError as error:
        raise MissingExtraError("OpenAIGenerator", "rollout", "httpx") from error
    return httpx


class OpenAIGenerator:
    """Generate through the completions endpoint of the server at ``base_url`` serving ``model``.

    ``base_url`` is the server's root (``http://localhost:8000``: requests go to
    ``{base_url}/v1/completions``). ``publish`` (``"lora"``, ``"reload"`` or a hook) and
    ``publish_dir`` choose how :meth:`publish` reaches the server. ``transport`` is handed to
    ``httpx.AsyncClient`` (tests pass a fake). Close the client with ``await generator.aclose()``
    or ``async with OpenAIGenerator(...) as generator``.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        logprobs: LogprobMode = "model",
        timeout: float = 300.0,
        max_retries: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        publish: PublishRoute | PublishHook | None = None,
        publish_dir: str | Path | None = None,
        transport: Any = None,
    ) -> None:
        if max_retries < 0 or backoff < 0 or max_backoff < 0:
            raise ConfigError(
                f"max_retries, backoff and max_backoff must be >= 0, got {max_retries}, {backoff}, {max_backoff}"
            )
        httpx = _import_httpx()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._httpx = httpx
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )
        self.model = model
        self.logprobs_mode: LogprobMode = logprobs
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff
        self._jitter = random.Random()
        self._publisher = None if publish is None else Publisher(publish, publish_dir)

    async def __aenter__(self) -> OpenAIGenerator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()
        if self._publisher is not None:
            self._publisher.close()

    async def publish(self, model: nn.Module, version: int) -> None:
        """Make the server serve ``model``'s current weights as policy ``version`` (after an
        optimizer step, while no request is in flight); later requests use them."""
        if self._publisher is None:
            raise ConfigError(
                f"the generator for {self._client.base_url} has no publish route, so the server would keep "
                "its old weights; give publish='lora' (a LoRA policy), 'reload' (vLLM dev mode) or a hook"
            )
        await self._publisher.publish(self, model, version)
        _log.info("openai_policy_published", version=version, model=self.model)

    async def post(self, path: str, payload: dict[str, Any]) -> Any:
        """POST ``payload`` as JSON to ``{base_url}{path}`` with this generator's retries; the
        reply's JSON (its text when it is not JSON, as vLLM's adapter routes answer)."""
        response = await self._send(path, payload)
        try:
            return response.json()
        except ValueError:
            return response.text

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate a continuation of ``request.prompt_ids`` on the server."""
        if request.params.logprobs != self.logprobs_mode:
            raise BackendCapabilityError(
                f"the server returns {self.logprobs_mode!r} log-probs (its --logprobs-mode) but the "
                f"request asks for {request.params.logprobs!r}"
            )
        body = await self._post("/v1/completions", self._payload(request))
        return self._result(request, body)

    def _payload(self, request: GenerationRequest) -> dict[str, Any]:
        p = request.params
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": list(request.prompt_ids),
            "max_tokens": p.max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "logprobs": 1,
            "return_token_ids": True,
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": True,
            "skip_special_tokens": False,
        }
        if p.top_k > 0:
            payload["top_k"] = p.top_k
        if p.seed is not None:
            payload["seed"] = p.seed
        return payload

    async def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """:meth:`_send`, the reply's JSON object."""
        body: dict[str, Any] = (await self._send(path, payload)).json()
        return body

    async def _send(self, path: str, payload: dict[str, Any]) -> Any:
        """POST with retries (module docstring); the successful httpx response."""
        httpx = self._httpx
        for attempt in range(self.max_retries + 1):
            try:
                response = await self._client.post(path, json=payload)
            except httpx.TransportError as error:
                problem: str = f"{type(error).__name__}: {error}"
            else:
                if response.status_code < 400:
                    return response
                problem = f"HTTP {response.status_code}: {response.text[:500]}"
                if response.status_code not in _TRANSIENT_STATUS:
                    raise GenerationError(f"{self._client.base_url}{path} refused the request: {problem}")
            if attempt == self.max_retries:
                raise GenerationError(
                    f"{self._client.base_url}{path} failed {attempt + 1} times, giving up; last error: {problem}"
                )
            delay = min(self.max_backoff, self.backoff * 2**attempt) * self._jitter.uniform(0.5, 1.0)
            _log.warning("openai_request_retry", path=path, attempt=attempt + 1, delay_s=round(delay, 3), error=problem)
            await anyio.sleep(delay)
        raise AssertionError("unreachable")

    def _result(self, request: GenerationRequest, body: dict[str, Any]) -> GenerationResult:
        choice = body["choices"][0]
        tokens = choice.get("token_ids")
        if tokens is None:
            raise BackendCapabilityError(
                f"the server at {self._client.base_url} returned no token ids for model {self.model!r}: "
                "OpenAIGenerator needs `return_token_ids` support (vLLM's OpenAI server >= 0.10.2)"
            )
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None or len(logprobs) != len(tokens):
            raise BackendCapabilityError(
                f"the server at {self._client.base_url} returned {0 if logprobs is None else len(logprobs)} "
                f"log-probs for {len(tokens)} tokens: it must support `logprobs` on completions"
            )
        stopped = bool(tokens) and tokens[-1] in request.params.stop_token_ids
        details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
        return GenerationResult(
            token_ids=list(tokens),
            logprobs=[float(x) for x in logprobs],
            finish_reason="stop" if stopped else "length",
            prompt_len=len(request.prompt_ids),
            cached_tokens=int(details.get("cached_tokens") or 0),
        )
