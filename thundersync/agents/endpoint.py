"""`PolicyEndpoint`: OpenAI chat completions and completions, served by our generator, recorded exactly.

The endpoint answers the two OpenAI routes an agent app uses, for one episode at a time (an
:class:`~thundersync.agents.episode.EpisodeRecorder`), in OpenAI's JSON:

- ``chat/completions``: the first request's ``messages`` are rendered with the chat template and
  the request's ``tools``; a later request must repeat the conversation so far, the assistant's
  reply as it was returned, then new messages (tool results, a user turn), and only those are
  rendered, by the template, after the tokens already in the trajectory
  (:meth:`~thundersync.tools.ChatTemplate.observation_ids`): the prompt is never re-tokenized. The
  reply's ``content`` is the completion's text (its end-of-turn token and tool-call blocks
  removed), ``tool_calls`` the calls the parser found (each with its JSON ``arguments``); a
  malformed call stays in ``content``. Model text never fails a request: a parser that raises
  on it, or a call whose arguments JSON cannot write (nested too deeply, not JSON values),
  leaves the text as ``content``; whatever a later request repeats of the conversation (names,
  arguments, content, however nested or large) is compared without raising, and a mismatch is
  refused as any other (HTTP 400).
- ``completions``: the prompt is text or token ids; a later prompt must extend the previous
  prompt and its completion (as text, or as ids), and only the new part is encoded.

Each reply also carries the exact ids (``prompt_token_ids`` and, per choice, ``token_ids``) and
the ``policy_version``; ``logprobs: true`` adds the behaviour log-probs. Sampling: the request's
``temperature``, ``top_p`` and ``seed`` (default: the endpoint's temperature and a seed derived
as the generate stage derives it), ``max_tokens`` / ``max_completion_tokens`` capped at the
endpoint's ``max_new_tokens``, the template's end-of-turn token as the stop token. ``n > 1``,
``stream`` and ``stop`` strings are refused (HTTP 400): they cannot be trained on as sampled.
"""

from __future__ import annotations

import json
import re
import time
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from thundersync._logging import get_logger
from thundersync.agents.episode import EpisodeRecorder, Turn
from thundersync.errors import AgentAppError
from thundersync.generation.base import GenerationRequest, GenerationResult, Generator, SamplingParams
from thundersync.sandboxes.output import Tokenizer
from thundersync.tools.base import ToolCall, ToolCallParser, safe_repr
from thundersync.tools.chat_template import ChatTemplate
from thundersync.tools.json_calls import JsonToolCallParser
from thundersync.tools.qwen import Qwen3ToolCallParser

__all__ = ["EndpointSettings", "PolicyEndpoint"]

_log = get_logger(__name__)

_CALL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)


class EndpointSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Defaults and bounds of the endpoint's sampling (the stage's config gives them)."""

    temperature: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    model: str = "policy"


class _ChatState(msgspec.Struct):
    """What the next chat request of an episode must repeat."""

    messages: list[dict[str, Any]] = []
    reply: dict[str, Any] = {}
    text: str = ""  # completions: the previous prompt text and its completion's text


class PolicyEndpoint:
    """Serves an episode's requests from ``generator`` (module docstring).

    ``chat``: the chat template (needed for ``chat/completions``); ``tokenizer``: encodes
    completions' text prompts (default: ``chat``); ``tool_format``: ``"qwen3"`` (``<tool_call>``
    blocks) or ``"json"`` (Llama 3's), how replies' tool calls are found; ``policy_version``:
    the live policy version (recorded per request).
    """

    def __init__(
        self,
        generator: Generator,
        *,
        chat: ChatTemplate | None = None,
        tokenizer: Tokenizer | None = None,
        tool_format: str = "qwen3",
        settings: EndpointSettings | None = None,
        policy_version: Callable[[], int] = lambda: 0,
    ) -> None:
        text = tokenizer if tokenizer is not None else chat
        if text is None:
            raise AgentAppError("an agent endpoint needs a chat template or a tokenizer", status=500)
        self.generator, self.chat, self.tokenizer = generator, chat, text
        self.settings = settings if settings is not None else EndpointSettings()
        self.parser: ToolCallParser = Qwen3ToolCallParser(text) if tool_format == "qwen3" else JsonToolCallParser(text)
        self._version = policy_version
        self._states: dict[int, _ChatState] = {}

    def forget(self, episode: EpisodeRecorder) -> None:
        """Drop what the endpoint keeps of a finished episode."""
        self._states.pop(id(episode), None)

    async def chat_completion(self, episode: EpisodeRecorder, body: Mapping[str, Any]) -> dict[str, Any]:
        """Answer one ``chat/completions`` request of ``episode``."""
        if self.chat is None:
            raise episode.refuse(AgentAppError("chat completions need a chat template; give the stage a chat object"))
        messages = _messages(body, episode)
        async with episode.lock:
            state = self._states.setdefault(id(episode), _ChatState())
            prompt = self._chat_prompt(episode, state, messages, body.get("tools") or [])
            turn, result = await self._generate(episode, prompt, body)
            reply = self._reply(result, turn)
            state.messages, state.reply = messages, reply
        message = {k: v for k, v in reply.items() if k != "finish_reason"}
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reply["finish_reason"]}
        choice["token_ids"] = result.token_ids
        if body.get("logprobs"):
            pieces = [self.tokenizer.decode([i]) for i in result.token_ids]
            choice["logprobs"] = {
                "content": [{"token": t, "logprob": lp, "top_logprobs": []} for t, lp in zip(pieces, result.logprobs)]
            }
        return self._envelope("chat.completion", prompt, result, choice)

    async def completion(self, episode: EpisodeRecorder, body: Mapping[str, Any]) -> dict[str, Any]:
        """Answer one ``completions`` request of ``episode``."""
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and not isinstance(raw[0], int):
            raw = raw[0]  # a batch of one prompt
        async with episode.lock:
            state = self._states.setdefault(id(episode), _ChatState())
            prompt = self._text_prompt(episode, state, raw)
            _, result = await self._generate(episode, prompt, body)
            text = self.tokenizer.decode(result.token_ids)
            state.text = (raw if isinstance(raw, str) else self.tokenizer.decode(prompt)) + text
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "finish_reason": result.finish_reason,
            "token_ids": result.token_ids,
            "logprobs": None,
        }
        if body.get("logprobs") is not None:
            pieces = [self.tokenizer.decode([i]) for i in result.token_ids]
            choice["logprobs"] = {"tokens": pieces, "token_logprobs": result.logprobs}
        return self._envelope("text_completion", prompt, result, choice)

    # --- prompts ---------------------------------------------------------------------------------

    def _chat_prompt(
        self, episode: EpisodeRecorder, state: _ChatState, messages: list[dict[str, Any]], tools: Any
    ) -> list[int]:
        assert self.chat is not None
        if not episode.turns:
            return self.chat.prompt_ids(messages, tools=tools)
        seen = len(state.messages)
        same = [_normal(m) for m in messages[:seen]] == [_normal(m) for m in state.messages]
        if not same or len(messages) <= seen or _normal(messages[seen]) != _normal(state.reply):
            raise episode.refuse(
                AgentAppError(
                    f"request {len(episode.turns)} of trajectory {episode.trajectory_id!r} (group {episode.group_id!r}) "
                    "does not continue its conversation: send the previous request's messages, then the assistant's "
                    "reply as it was returned, then the new messages (an episode is one conversation)"
                )
            )
        new = messages[seen + 1 :]
        if not new:
            raise episode.refuse(
                AgentAppError("a request that continues a conversation must add a message after the reply")
            )
        after = episode.turns[-1].completion_ids
        return [*episode.context, *self.chat.observation_ids(new, after=after)]

    def _text_prompt(self, episode: EpisodeRecorder, state: _ChatState, raw: Any) -> list[int]:
        ids = _token_ids(raw)
        if ids is not None:
            return ids
        if not isinstance(raw, str) or not raw:
            raise episode.refuse(AgentAppError(f"prompt must be text or token ids, got {str(raw)[:80]!r}"))
        if not episode.turns:
            return list(self.tokenizer.encode(raw))
        if not raw.startswith(state.text) or raw == state.text:
            raise episode.refuse(
                AgentAppError(
                    f"request {len(episode.turns)} of trajectory {episode.trajectory_id!r}: the prompt must be the "
                    "previous prompt, its completion and then new text"
                )
            )
        return [*episode.context, *self.tokenizer.encode(raw[len(state.text) :])]

    # --- generation ------------------------------------------------------------------------------

    async def _generate(
        self, episode: EpisodeRecorder, prompt: list[int], body: Mapping[str, Any]
    ) -> tuple[int, GenerationResult]:
        params = self._params(episode, body)
        turn = await episode.begin(prompt)
        key = f"{self.settings.seed}/{episode.group_id!r}/{episode.trajectory_id}/{turn}".encode()
        if params.seed is None:
            params = msgspec.structs.replace(params, seed=zlib.crc32(key))
        session = f"{episode.group_id!r}/{episode.trajectory_id}"
        started = self._version()
        result = await self.generator.generate(GenerationRequest(prompt_ids=prompt, params=params, session_id=session))
        ended = self._version()
        episode.record(
            Turn(
                prompt_ids=prompt,
                completion_ids=list(result.token_ids),
                logprobs=list(result.logprobs),
                policy_version=started,
                ended_policy_version=None if ended == started else ended,
                finish_reason=result.finish_reason,
            )
        )
        return turn, result

    def _params(self, episode: EpisodeRecorder, body: Mapping[str, Any]) -> SamplingParams:
        refused = [
            name
            for name, bad in (
                ("n", body.get("n", 1) not in (1, None)),
                ("stream", bool(body.get("stream"))),
                ("stop", bool(body.get("stop"))),
            )
            if bad
        ]
        if refused:
            raise episode.refuse(
                AgentAppError(
                    f"the agent endpoint does not serve {', '.join(refused)}: one completion per request, whole, "
                    "stopped by the model's end-of-turn token (what is trained on must be exactly what was sampled)"
                )
            )
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or self.settings.max_new_tokens
        temperature = body.get("temperature")
        try:
            return SamplingParams(
                temperature=self.settings.temperature if temperature is None else temperature,
                top_p=1.0 if body.get("top_p") is None else body["top_p"],
                max_new_tokens=min(int(limit), self.settings.max_new_tokens),
                stop_token_ids=self.settings.stop_token_ids,
                seed=body.get("seed"),
            )
        except (ValueError, TypeError) as error:
            raise episode.refuse(AgentAppError(f"bad sampling options: {error}")) from None

    # --- replies ---------------------------------------------------------------------------------

    def _reply(self, result: GenerationResult, turn: int) -> dict[str, Any]:
        ids = list(result.token_ids)
        if ids and ids[-1] in self.settings.stop_token_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        calls = self._wire_calls(result.token_ids, turn)
        reply: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            reply["content"] = _without_calls(text)
            reply["tool_calls"] = calls
        reason = "tool_calls" if calls else "length" if result.finish_reason == "length" else "stop"
        return {**reply, "finish_reason": reason}

    def _wire_calls(self, token_ids: Sequence[int], turn: int) -> list[dict[str, Any]]:
        """The well-formed calls of a completion, as the reply's ``tool_calls``; a parser that
        raises finds none, and a call whose arguments JSON cannot write is left out."""
        try:
            calls = [call for call in self.parser.parse(token_ids) if call.error is None]
        except Exception as error:  # model text must not fail the request
            _log.warning("tool-call parser failed; the reply is text", error=f"{type(error).__name__}: {error}"[:200])
            return []
        wired: list[dict[str, Any]] = []
        for call in calls:
            try:
                wired.append(_wire_call(call, f"call_{turn}_{len(wired)}"))
            except Exception:  # RecursionError, TypeError (not JSON values), ValueError (circular)
                continue
        return wired

    def _envelope(
        self, kind: str, prompt: list[int], result: GenerationResult, choice: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": f"thundersync-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.settings.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(result.token_ids),
                "total_tokens": len(prompt) + len(result.token_ids),
            },
            "prompt_token_ids": prompt,
            "policy_version": self._version(),
        }


def _messages(body: Mapping[str, Any], episode: EpisodeRecorder) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise episode.refuse(AgentAppError("messages must be a non-empty list of chat messages"))
    return [dict(message) for message in messages]


def _token_ids(raw: Any) -> list[int] | None:
    if isinstance(raw, list) and raw and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in raw):
        return list(raw)
    return None


def _without_calls(text: str) -> str:
    """``text`` without its ``<tool_call>`` blocks, or empty when it is JSON calls."""
    if text.lstrip().startswith("{"):
        return ""
    return _CALL_BLOCK.sub("", text).strip()


def _wire_call(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }


def _normal(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as compared between requests: its role, text and calls (ids and None fields
    dropped), every part a string, so that comparing never recurses into what the app sent."""
    out: dict[str, Any] = {"role": _text(message.get("role")), "content": _content(message.get("content"))}
    calls = message.get("tool_calls") or []
    out["tool_calls"] = [_call_key(call) for call in calls] if isinstance(calls, list) else [_text(calls)]
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and message.get("role") == "tool":
            out[key] = _text(message[key])
    return out


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, Sequence) and not isinstance(content, str):  # content parts
        return "".join(_text(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return _text(content)


def _text(value: Any) -> str:
    """``value`` as a string, whatever it holds (a deeply nested list, an int past the digit limit)."""
    return value if isinstance(value, str) else safe_repr(value, limit=1 << 20)


def _call_key(call: Any) -> tuple[str, str]:
    """A call's name and its arguments as canonical JSON (sorted keys), or as sent when they are
    not JSON that can be read and written back (bad, nested too deeply, numbers past the digit limit)."""
    function = call.get("function", call) if isinstance(call, Mapping) else {}
    arguments = function.get("arguments")
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
        written = json.dumps(value, sort_keys=True)
    except Exception:
        written = _text(arguments)
    return _text(function.get("name")), written
