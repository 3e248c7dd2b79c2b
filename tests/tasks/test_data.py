"""JSONL tasks, the arithmetic tasks, and the source stage that submits them with their fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thundersync.errors import ConfigError
from thundersync.stages.source import SourceStage
from thundersync.tasks import ArithmeticTasks, JsonlTasks, Task
from thundersync.tools.base import ByteTokenizer


def _jsonl(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_text_and_id_prompts_keep_their_other_keys_as_fields(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, '{"prompt": "2+3?", "answer": "5"}', "", '{"prompt_ids": [7, 8], "answer": "12", "n": [1]}')
    assert JsonlTasks(str(path)).tasks() == [
        Task(prompt_ids=list(b"2+3?"), fields={"prompt": "2+3?", "answer": "5"}),  # the text, for an agent app
        Task(prompt_ids=[7, 8], fields={"answer": "12", "n": [1]}),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"answer": "5"}',
            r"tasks\.jsonl:2: a task needs exactly one of 'prompt' \(text\), 'messages' \(a chat\) and 'prompt_ids', "
            "got neither",
        ),
        ('{"prompt": "a", "prompt_ids": [1]}', r"tasks\.jsonl:2: .* got 'prompt' and 'prompt_ids'"),
        ('{"prompt": "a",', r"tasks\.jsonl:2: not valid JSON \("),
        ("[1, 2]", r"tasks\.jsonl:2: a task line must be a JSON object, got list"),
        (
            '{"prompt_ids": [1, -3]}',
            r"tasks\.jsonl:2: 'prompt_ids' must be a non-empty list of token ids in \[0, 2\*\*31\), got \[1, -3\]",
        ),
        ('{"prompt_ids": []}', r"tasks\.jsonl:2: 'prompt_ids' must be a non-empty list"),
        ('{"prompt": ""}', r"tasks\.jsonl:2: 'prompt' must be non-empty text, got ''"),
    ],
)
def test_a_bad_line_names_the_file_the_line_and_the_problem(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JsonlTasks(str(_jsonl(tmp_path, '{"prompt": "ok"}', line)))


@pytest.mark.parametrize("depth", [65, 200_000])
def test_a_line_nested_too_deeply_names_the_file_the_line_and_the_limit(tmp_path: Path, depth: int) -> None:
    line = '{"prompt": "a", "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    with pytest.raises(ConfigError, match=r"tasks\.jsonl:2: the task nests objects and arrays more than 64 levels"):
        JsonlTasks(str(_jsonl(tmp_path, '{"prompt": "ok"}', line)))
    deep_enough = '{"prompt": "a", "x": ' + "[" * 63 + "]" * 63 + "}"  # 64 levels: accepted
    assert len(JsonlTasks(str(_jsonl(tmp_path, deep_enough))).tasks()) == 1


def test_a_missing_or_empty_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read the task file .*nope\.jsonl: No such file or directory"):
        JsonlTasks(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match=r"tasks\.jsonl: no tasks \(the file has no non-blank line\)"):
        JsonlTasks(str(_jsonl(tmp_path, "", "  ")))


def test_arithmetic_tasks_are_seeded_and_carry_the_right_answer() -> None:
    tasks = ArithmeticTasks(count=50, seed=3)
    assert tasks.tasks() == ArithmeticTasks(count=50, seed=3).tasks()
    assert tasks.expressions() != ArithmeticTasks(count=50, seed=4).expressions()
    for expression, task in zip(tasks.expressions(), tasks.tasks()):
        assert task.fields == {"answer": str(eval(expression)), "expression": expression}
        text = ByteTokenizer().decode(task.prompt_ids)
        assert text == f"What is {expression}? Use the calculator tool, then answer with <answer>N</answer>."


def test_arithmetic_tasks_refuse_an_empty_range() -> None:
    with pytest.raises(ConfigError, match=r"low <= high, got count=1, \[5, 4\]"):
        ArithmeticTasks(count=1, low=5, high=4)


def test_the_source_shuffles_each_epoch_by_seed_and_sends_the_fields() -> None:
    tasks = ArithmeticTasks(count=6, seed=1)
    config = SourceStage.Config(groups_per_batch=4, repeat=2, shuffle_seed=7, samples=2)
    out = SourceStage(config, tasks=tasks).submissions()
    assert out == SourceStage(config, tasks=tasks).submissions()
    by_prompt = {tuple(t.prompt_ids): t.fields for t in tasks.tasks()}
    assert all(e.task == by_prompt[tuple(e.prompt_tokens)] for e in out)
    first, second = [e.task["expression"] for e in out[:6]], [e.task["expression"] for e in out[6:]]
    assert sorted(first) == sorted(second) == sorted(tasks.expressions())
    assert first != tasks.expressions() and first != second  # shuffled, and anew per epoch
    assert [e.batch_id for e in out] == [0] * 4 + [1] * 4 + [2] * 4


def test_a_resumed_shuffled_source_continues_with_the_same_groups() -> None:
    config = SourceStage.Config(groups_per_batch=2, repeat=3, shuffle_seed=0)
    everything = SourceStage(config, tasks=ArithmeticTasks(count=4)).submissions()
    resumed = SourceStage(config, tasks=ArithmeticTasks(count=4))
    resumed.skip_batches([0, 1, 2])
    assert resumed.submissions() == everything[6:]


def test_a_source_needs_prompts_or_tasks_not_both() -> None:
    with pytest.raises(ConfigError, match=r"exactly one of prompts .* got neither"):
        SourceStage(SourceStage.Config())
    with pytest.raises(ConfigError, match=r"exactly one of prompts .* got both"):
        SourceStage(SourceStage.Config(prompts=[[1]]), tasks=ArithmeticTasks(count=1))


def test_a_messages_record_is_rendered_with_the_chat_template_and_kept(tmp_path: Path) -> None:
    from tests.tools.chat_helpers import chat

    template = chat("qwen3")
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    path = _jsonl(tmp_path, json.dumps({"messages": conversation, "answer": "5"}), '{"prompt": "7*8?"}')
    first, second = JsonlTasks(str(path), chat=template).tasks()
    assert first == Task(prompt_ids=template.prompt_ids(conversation), fields={"messages": conversation, "answer": "5"})
    assert second.prompt_ids == template.prompt_ids([{"role": "user", "content": "7*8?"}])  # text: one user message


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"messages": [{"role": "user", "content": "hi"}]}', r"a 'messages' prompt is rendered with a chat template"),
        ('{"messages": []}', r"'messages' must be a non-empty list of chat messages"),
        ('{"messages": [{"content": "hi"}]}', r"messages\[0\] must be an object with a 'role' and a 'content'"),
        ('{"messages": [{"role": "user", "content": 3}]}', r"messages\[0\].content must be text, got 3"),
    ],
)
def test_a_bad_messages_record_names_its_line(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"tasks\.jsonl:1: " + message):
        JsonlTasks(str(_jsonl(tmp_path, line)))
