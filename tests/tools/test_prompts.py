"""Prompts publish the tools' schemas to the model in the chat format its tokenizer expects: the
tokenizer's own chat template when it has one, else Qwen3's, written exactly as Qwen3's template
writes it (checked against that template rendered by transformers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.tasks.test_swebench import instance, write
from thundersync.tasks import RepoBugTasks, SWEBenchTasks
from thundersync.testing import FakeSandbox
from thundersync.tools import (
    ByteTokenizer,
    SandboxToolRunner,
    coding_tools,
    qwen3_tool_prompt,
    tool_prompt,
)

TOKENS = ByteTokenizer()

# Qwen3's chat template (its tokenizer_config.json), the parts that render a system and a user turn
QWEN3_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    '{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def runner() -> SandboxToolRunner:
    return SandboxToolRunner(FakeSandbox, tools=coding_tools().values())


def hf_tokenizer(chat_template: str) -> Any:
    """A byte-level BPE made here (no download) with ``chat_template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["def f(a, b): return a - b", '{"name": "view"}'], trainer=trainer)
    made = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    made.chat_template = chat_template
    return made


def test_a_prompt_without_a_chat_template_lists_every_tool_schema_in_qwen3s_format() -> None:
    schemas = runner().schemas
    text = TOKENS.decode(tool_prompt("Fix ops.py.", schemas, TOKENS))
    head, tools = text.split("<tools>\n", 1)
    listed, tail = tools.split("\n</tools>", 1)
    assert head == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
    )
    assert [json.loads(line) for line in listed.splitlines()] == schemas
    assert [s["function"]["name"] for s in schemas] == ["view", "create", "replace", "search", "submit"]
    assert tail.endswith("</tool_call><|im_end|>\n<|im_start|>user\nFix ops.py.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("system", [None, "You are a careful engineer."])
@pytest.mark.parametrize("with_tools", [True, False])
def test_the_qwen3_prompt_is_what_qwen3s_own_template_renders(system: str | None, with_tools: bool) -> None:
    schemas = runner().schemas if with_tools else []
    tokenizer = hf_tokenizer(QWEN3_TEMPLATE)
    ids = tool_prompt("Fix ops.py: f(a, b) returns a - b.", schemas, tokenizer, system=system)
    assert tokenizer.decode(ids) == qwen3_tool_prompt("Fix ops.py: f(a, b) returns a - b.", schemas, system=system)


def test_a_tokenizer_with_its_own_chat_template_publishes_the_tools_its_own_way() -> None:
    template = "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}ASK {{ messages[-1].content }}"
    tokenizer = hf_tokenizer(template)
    assert tokenizer.decode(tool_prompt("fix it", runner().schemas, tokenizer)) == (
        "TOOL view\nTOOL create\nTOOL replace\nTOOL search\nTOOL submit\nASK fix it"
    )


def test_swebench_tasks_given_the_tools_publish_them_in_the_prompt(tmp_path: Path) -> None:
    path = str(write(tmp_path / "i.jsonl", [instance(tmp_path / "repos")]))
    plain = SWEBenchTasks(path=path, image="img:{instance_id}").tasks()[0]
    (task,) = SWEBenchTasks(path=path, image="img:{instance_id}", tools=runner(), system="Be brief.").tasks()
    text = TOKENS.decode(task.prompt_ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "submit"' in text
    assert TOKENS.decode(plain.prompt_ids) in text and task.fields == plain.fields


def test_repo_bug_tasks_given_the_tools_publish_them_and_keep_their_fields() -> None:
    plain = RepoBugTasks(count=2, seed=3).tasks()
    published = RepoBugTasks(count=2, seed=3, tools=runner()).tasks()
    for old, new in zip(plain, published, strict=True):
        assert new.fields == old.fields
        assert TOKENS.decode(new.prompt_ids) == qwen3_tool_prompt(TOKENS.decode(old.prompt_ids), runner().schemas)


@pytest.mark.parametrize("style", ["qwen3", "llama3"])
def test_a_chat_template_object_renders_the_prompt_as_it_renders_the_tool_turns(style: Any) -> None:
    from thundersync.tools import ChatTemplate, chat_tokenizer

    chat = ChatTemplate(chat_tokenizer(style))
    ids = tool_prompt("Fix ops.py.", runner().schemas, chat, system="Be brief.")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fix ops.py."}]
    assert ids == chat.prompt_ids(messages, tools=runner().schemas)
    assert "submit" in chat.decode(ids)
