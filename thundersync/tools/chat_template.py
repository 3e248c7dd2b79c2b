"""`ChatTemplate`: prompts and tool observations rendered by the tokenizer's own chat template.

A prompt may be a list of chat messages; it is rendered with the tokenizer's template
(``apply_chat_template``, the tools' JSON schemas as ``tools=``, the generation prompt added)::

    chat = ChatTemplate(tokenizer, tools=default_tools().values())
    prompt_ids = chat.prompt_ids([{"role": "user", "content": "What is 17 * 23?"}])
    generate = GenerateStage(cfg, generator=g, tool_calls=ChatTemplateToolCalls(chat))   # stop: chat.stop_token_ids
    tools = SandboxToolRunner(sandbox, tokenizer=chat, parser=ChatTemplateToolCalls(chat))

Turn boundaries are exact in token space: a trajectory is the prompt's tokens, then each action's
tokens exactly as the generator produced them, then the template's tokens for what follows the
action (its tool results through the template's ``tool`` role, and the next generation prompt),
never a re-tokenization of the conversation's text. Those observation tokens are the template's
text after the assistant turn's end-of-turn token (``end_of_turn``, default the tokenizer's
``eos_token``), rendered after a fixed two-message anchor, so they depend only on the new messages;
an action that ended without that token (it hit its token budget) gets it first. Text is encoded
with no special tokens added (the template writes its own) and decoded with them kept, so
``decode(encode(text)) == text`` for template text and special tokens are never split.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from thundersync.errors import ConfigError
from thundersync.tools.base import ToolCall, ToolCallParser
from thundersync.tools.commands import Tool
from thundersync.tools.qwen import Qwen3ToolCallParser

__all__ = ["ChatTemplate", "ChatTemplateToolCalls", "ChatTokenizer", "Message"]

Message = Mapping[str, Any]
"""One chat message as transformers' templates read it: ``{"role": ..., "content": ...}`` (and
``tool_calls`` on an assistant message)."""

_ANCHOR: tuple[dict[str, str], ...] = ({"role": "user", "content": "."}, {"role": "assistant", "content": "."})


@runtime_checkable
class ChatTokenizer(Protocol):
    """A transformers tokenizer with a chat template (what :class:`ChatTemplate` needs of it)."""

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any: ...

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> Any: ...

    def convert_tokens_to_ids(self, tokens: Any) -> Any: ...


def _schemas(tools: Iterable[Tool | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI function schemas of ``tools`` (a :class:`Tool` gives its ``schema``)."""
    return [dict(tool) if isinstance(tool, Mapping) else tool.schema for tool in tools]


class ChatTemplate:
    """Renders chat messages into token ids with ``tokenizer``'s chat template (module docstring).

    ``tools``: the tools the model is told of in every prompt (:class:`Tool` objects or OpenAI
    function schemas); ``end_of_turn``: the token that ends an assistant turn (default the
    tokenizer's ``eos_token``); ``template``: a Jinja template to use instead of the tokenizer's.
    It is also a :class:`~thundersync.tools.base.Tokenizer` (``encode``/``decode``), exact for
    template text.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        tools: Iterable[Tool | Mapping[str, Any]] = (),
        end_of_turn: str | None = None,
        template: str | None = None,
    ) -> None:
        if not isinstance(tokenizer, ChatTokenizer):
            raise ConfigError(
                f"a chat template needs a transformers tokenizer (apply_chat_template), got a {type(tokenizer).__name__}; "
                "the byte tokenizer has no chat template: give prompts as text, or load a tokenizer that has one"
            )
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"the tokenizer {type(tokenizer).__name__} has no chat_template; set tokenizer.chat_template "
                "or give ChatTemplate(template=...)"
            )
        self.tokenizer = tokenizer
        self.tools = _schemas(tools)
        self.template = template
        eot = end_of_turn if end_of_turn is not None else getattr(tokenizer, "eos_token", None)
        if not isinstance(eot, str) or not eot:
            raise ConfigError("the tokenizer has no eos_token; give ChatTemplate(end_of_turn=...) (e.g. '<|im_end|>')")
        ids = self.encode(eot)
        if len(ids) != 1:
            raise ConfigError(
                f"end_of_turn {eot!r} encodes to {len(ids)} tokens {ids}; it must be one (special) token of the tokenizer"
            )
        self.end_of_turn = eot
        self.end_of_turn_id = ids[0]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The token ids that end an assistant turn (give them to generation as stop tokens)."""
        return (self.end_of_turn_id,)

    def encode(self, text: str, /) -> list[int]:
        """``text``'s token ids, no special tokens added (template text writes its own)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], /) -> str:
        """The text of ``ids``, special tokens kept."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Iterable[Tool | Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's text for ``messages`` (``tools``: these instead of the template's own)."""
        schemas = self.tools if tools is None else _schemas(tools)
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(message) for message in messages],
                tools=schemas or None,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as error:  # jinja's errors (a raise_exception of the template, a bad message)
            raise ConfigError(
                f"the chat template cannot render these messages: {type(error).__name__}: {error}"
            ) from None
        return str(text)

    def prompt_ids(
        self, messages: Sequence[Message], *, tools: Iterable[Tool | Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The token ids of a prompt: ``messages`` rendered with the tools and the generation prompt."""
        if not messages:
            raise ConfigError("a chat prompt needs at least one message")
        return self.encode(self.render(messages, tools=tools))

    def observation_text(self, messages: Sequence[Message]) -> str:
        """What the template writes after an assistant turn's end-of-turn token for ``messages``
        (tool results, a user turn), the next generation prompt included."""
        anchor = self.render(_ANCHOR, tools=(), add_generation_prompt=False)
        cut = anchor.rfind(self.end_of_turn)
        if cut < 0:
            raise ConfigError(
                f"the chat template does not end an assistant turn with {self.end_of_turn!r}; give "
                "ChatTemplate(end_of_turn=...) the token it does end one with"
            )
        cut += len(self.end_of_turn)
        full = self.render([*_ANCHOR, *messages], tools=(), add_generation_prompt=True)
        if not full.startswith(anchor[:cut]):
            raise ConfigError(
                "the chat template writes earlier messages differently once later ones follow, so tool "
                "observations cannot be appended in token space; use a template that renders each message on its own"
            )
        return full[cut:]

    def observation_ids(self, messages: Sequence[Message], *, after: Sequence[int] = ()) -> list[int]:
        """The tokens of :meth:`observation_text`; when ``after`` (the action's ids) does not end
        with the end-of-turn token, the observation starts with it (the template would close the turn)."""
        ids = self.encode(self.observation_text(messages))
        if after and after[-1] != self.end_of_turn_id:
            ids = [self.end_of_turn_id, *ids]
        return ids

    def tool_observation(self, responses: Sequence[str]) -> str:
        """:meth:`observation_text` of one ``tool`` message per response."""
        return self.observation_text([{"role": "tool", "content": response} for response in responses])


class ChatTemplateToolCalls:
    """A :class:`~thundersync.tools.base.ToolCallParser` that finds calls with ``parser`` (default
    Qwen3's ``<tool_call>`` JSON) and answers them through the template's ``tool`` role.

    Give the sandbox runner the same :class:`ChatTemplate` as its tokenizer, so the observation's
    text encodes to exactly the template's tokens.
    """

    def __init__(self, chat: ChatTemplate, parser: ToolCallParser | None = None) -> None:
        self.chat = chat
        self.parser: ToolCallParser = parser if parser is not None else Qwen3ToolCallParser(chat)

    def parse(self, token_ids: Sequence[int]) -> list[ToolCall]:
        return self.parser.parse(token_ids)

    def observation(self, responses: Sequence[str]) -> str:
        return self.chat.tool_observation(responses)
