"""The chat and agent factories of pipeline files: tokenizers with templates, chat objects, apps."""

from __future__ import annotations

from pathlib import Path

import pytest

from thundersync.agents import FunctionApp, load_app_function
from thundersync.app.files.build import build_objects
from thundersync.app.files.check import check_pipeline
from thundersync.app.files.definition import loads
from thundersync.errors import ConfigError, DefinitionError
from thundersync.tools import ChatTemplate, ChatTemplateToolCalls, JsonToolCallParser, SandboxToolRunner

ROOT = Path(__file__).resolve().parents[3]
OBJECTS = """
[objects.tokenizer]
factory = "tokenizer"
builtin = "{style}-chat"
[objects.chat]
factory = "chat-template"
tokenizer = {{ object = "tokenizer" }}
tools = ["calculator"]
[objects.calls]
factory = "chat-tool-calls"
chat = {{ object = "chat" }}
format = "{format}"
[objects.tools]
factory = "chat-sandbox-tools"
chat = {{ object = "chat" }}
backend = "local"
tools = ["calculator"]                  # (local runs no tool that runs model text unless the file opts in)
format = "{format}"
[stages.source]
type = "source"
prompts = [[1]]
"""


@pytest.mark.parametrize(("style", "format"), [("qwen3", "qwen3"), ("llama3", "json")])
def test_a_file_builds_a_chat_template_its_tool_calls_and_its_sandbox_tools(style: str, format: str) -> None:
    objects = build_objects(loads(OBJECTS.format(style=style, format=format)))
    chat, calls, tools = objects["chat"], objects["calls"], objects["tools"]
    assert isinstance(chat, ChatTemplate) and chat.tools[0]["function"]["name"] == "calculator"
    assert chat.end_of_turn == ("<|im_end|>" if style == "qwen3" else "<|eot_id|>")
    assert len(chat.tokenizer) <= 264  # fits the examples' vocab_size = 264
    assert isinstance(calls, ChatTemplateToolCalls) and isinstance(calls.parser, JsonToolCallParser) == (
        format == "json"
    )
    assert isinstance(tools, SandboxToolRunner) and tools.tokenizer is chat
    assert tools.parser.observation(["391"]) == chat.tool_observation(["391"])


def test_check_accepts_the_new_example_files() -> None:
    for name in ("openai_agent.toml", "verifiers_env.toml"):
        text = (ROOT / "examples" / name).read_text()
        check_pipeline(loads(text))


def test_check_refuses_an_agent_app_stage_without_an_app() -> None:
    text = (ROOT / "examples" / "openai_agent.toml").read_text().replace("[objects.app]", "[objects.not_app]")
    with pytest.raises(DefinitionError, match=r"stages.app: a 'agent-app' stage needs a runtime object 'app'"):
        check_pipeline(loads(text))


def test_an_app_function_is_loaded_from_a_module_or_a_file(tmp_path: Path) -> None:
    assert FunctionApp(function=f"{ROOT / 'examples' / 'openai_agent.py'}:solve").function.__name__ == "solve"
    assert load_app_function("tests.agents.test_agent_app:_events").__name__ == "_events"
    (tmp_path / "sync.py").write_text("def agent(client, task):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"must be an async function agent\(client, task\), got function"):
        load_app_function(f"{tmp_path / 'sync.py'}:agent")
    with pytest.raises(ConfigError, match=r"cannot load the agent app 'nowhere.py:agent'"):
        load_app_function("nowhere.py:agent")
    with pytest.raises(ConfigError, match=r"is given as 'module:function' or 'file.py:function', got 'solve'"):
        load_app_function("solve")


def test_chat_sandbox_tools_offer_the_coding_tools_and_refuse_local_for_model_text_unless_opted_in() -> None:
    from thundersync.app.factories.chat import chat_sandbox_tools, chat_template
    from thundersync.tools import chat_tokenizer

    chat = chat_template(tokenizer=chat_tokenizer("qwen3"))
    with pytest.raises(ConfigError, match=r"the local backend runs host processes \(no isolation\), and the tools"):
        chat_sandbox_tools(chat=chat, backend="local", tools=("view", "shell"))
    tools = chat_sandbox_tools(chat=chat, backend="docker", image="img:1", tools=("view", "replace", "submit"))
    assert list(tools.tools) == ["view", "replace", "submit"] and tools.tokenizer is chat
    assert tools.parser.observation(["ok"]) == chat.tool_observation(["ok"])
