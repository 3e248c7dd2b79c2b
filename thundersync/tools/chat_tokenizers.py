"""Chat tokenizers built in code: byte-level BPE with a Qwen3-style or a Llama-3-style chat template.

Nothing is downloaded: :func:`chat_tokenizer` makes a transformers ``PreTrainedTokenizerFast``
over a byte-level BPE (the 256 bytes, merges learned from ``corpus`` when one is given) plus the
style's special tokens, and sets its ``chat_template`` to :data:`QWEN3_TEMPLATE` or
:data:`LLAMA3_TEMPLATE`. They write the two families' formats (Qwen3's ``<|im_start|>`` turns with
``<tools>`` in the system turn, ``<tool_call>`` JSON and ``<tool_response>`` blocks in a user
turn; Llama 3's header turns, ``{"name": ..., "parameters": ...}`` calls and the ``ipython``
role), without the real templates' extras (dates, reasoning blocks). The shipped examples and the
tests use them; give a real model its own tokenizer (``tokenizer`` factory, ``path = ...``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from thundersync.errors import MissingExtraError

__all__ = ["LLAMA3_TEMPLATE", "QWEN3_TEMPLATE", "ChatStyle", "chat_tokenizer"]

ChatStyle = Literal["qwen3", "llama3"]

QWEN3_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    '{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{%- if loop.first and message.content %}{{- '\\n' }}{%- elif not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A Qwen3-style chat template (Hermes tool calls), without reasoning blocks."""

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- if system or tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system }}"
    "{%- if tools %}{%- if system %}{{- '\\n\\n' }}{%- endif %}"
    "{{- 'You have access to the following functions. To call a function, respond with JSON of the form '"
    ' + \'{"name": function name, "parameters": dictionary of argument name and its value}.\' }}'
    "{%- for tool in tools %}{{- '\\n\\n' }}{{- tool | tojson }}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- if message.tool_calls %}"
    "{%- for call in message.tool_calls %}{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    '{{- \'{"name": "\' + call.name + \'", "parameters": \' }}'
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}' }}{%- endfor %}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""A Llama-3-style chat template (JSON tool calls, tool results in the ``ipython`` role)."""

_SPECIAL: dict[str, dict[str, Any]] = {
    "qwen3": {
        "tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": QWEN3_TEMPLATE,
    },
    "llama3": {
        "tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"],
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
    },
}


def chat_tokenizer(style: ChatStyle = "qwen3", *, corpus: Iterable[str] = (), vocab_size: int = 256) -> Any:
    """A ``PreTrainedTokenizerFast``: byte-level BPE with ``style``'s special tokens and template.

    Without ``corpus`` the vocabulary is the 256 bytes (then the special tokens); with one, merges
    are learned from it up to ``vocab_size`` tokens (deterministic for a given corpus). A model
    used with it needs ``vocab_size >= len(tokenizer)``.
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError as error:
        raise MissingExtraError("a chat tokenizer built in code", "train", "tokenizers") from error
    if style not in _SPECIAL:
        raise ValueError(f"unknown chat style {style!r}; give 'qwen3' or 'llama3'")
    spec = _SPECIAL[style]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size, 256), initial_alphabet=alphabet, show_progress=False)
    bpe.train_from_iterator(list(corpus) or [""], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=bpe)  # type: ignore[no-untyped-call]
    wrapped.add_special_tokens({"additional_special_tokens": list(spec["tokens"])})
    for role in ("bos_token", "eos_token", "pad_token"):
        if role in spec:
            setattr(wrapped, role, spec[role])
    wrapped.chat_template = spec["chat_template"]
    return wrapped
