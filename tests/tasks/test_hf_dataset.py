"""The ``dataset`` task source: local files and saved datasets the tests build, columns, streaming."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.tools.chat_helpers import chat
from thundersync.errors import ConfigError, MissingExtraError
from thundersync.stages.source import SourceStage
from thundersync.tasks import Task
from thundersync.tasks.hf_dataset import DatasetTasks, StreamingDatasetTasks, _Rows, dataset_tasks

datasets = pytest.importorskip("datasets")

ROWS = {"question": ["2+3?", "7*8?", "9-4?", "1+1?", "6/2?"], "solution": ["5", "56", "5", "2", "3"]}


def _table(rows: dict[str, list[Any]] | None = None) -> Any:
    return datasets.Dataset.from_dict(rows if rows is not None else ROWS)


def _write(tmp_path: Path, suffix: str, rows: dict[str, list[Any]] | None = None) -> Path:
    table, path = _table(rows), tmp_path / f"train{suffix}"
    if suffix == ".parquet":
        table.to_parquet(str(path))
    elif suffix in (".json", ".jsonl"):
        table.to_json(str(path))
    elif suffix == ".csv":
        table.to_csv(str(path), index=False)
    else:
        table.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    return path


def _load(path: Path | str, tmp_path: Path, **options: Any) -> DatasetTasks | StreamingDatasetTasks:
    columns = options.pop("columns", {"prompt": "question", "answer": "solution"})
    return dataset_tasks(path=str(path), cache_dir=str(tmp_path / "cache"), columns=columns, **options)


def _expected(*, csv: bool = False) -> list[Task]:
    return [
        Task(prompt_ids=list(q.encode()), fields={"prompt": q, "answer": int(a) if csv else a})  # CSV infers numbers
        for q, a in zip(ROWS["question"], ROWS["solution"])
    ]


@pytest.mark.parametrize("suffix", [".parquet", ".json", ".jsonl", ".csv", ".arrow"])
def test_a_local_file_becomes_tasks_with_the_mapped_columns(tmp_path: Path, suffix: str) -> None:
    tasks = _load(_write(tmp_path, suffix), tmp_path)
    assert isinstance(tasks, DatasetTasks) and tasks.tasks() == _expected(csv=suffix == ".csv")


def test_a_saved_dataset_dict_gives_its_split_and_a_saved_dataset_itself(tmp_path: Path) -> None:
    datasets.DatasetDict({"train": _table(), "test": _table().select([1])}).save_to_disk(str(tmp_path / "dict"))
    assert isinstance(test := _load(tmp_path / "dict", tmp_path, split="test"), DatasetTasks)
    assert test.tasks() == _expected()[1:2]
    _table().save_to_disk(str(tmp_path / "one"))
    assert isinstance(whole := _load(tmp_path / "one", tmp_path), DatasetTasks)
    assert whole.tasks() == _expected()


def test_without_columns_every_column_is_taken_under_its_own_name(tmp_path: Path) -> None:
    rows = {"prompt": ["hi"], "answer": ["1"], "level": [3]}
    tasks = _load(_write(tmp_path, ".parquet", rows), tmp_path, columns=None)
    assert isinstance(tasks, DatasetTasks)
    assert tasks.tasks() == [Task(prompt_ids=list(b"hi"), fields={"prompt": "hi", "answer": "1", "level": 3})]


def test_a_messages_column_is_rendered_with_the_chat_template(tmp_path: Path) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    path = _write(tmp_path, ".parquet", {"chat": [conversation], "solution": ["5"]})
    template = chat("qwen3")
    tasks = _load(path, tmp_path, columns={"messages": "chat", "answer": "solution"}, chat=template)
    assert isinstance(tasks, DatasetTasks)
    (task,) = tasks.tasks()
    assert task.prompt_ids == template.prompt_ids(conversation)
    assert task.fields == {"messages": conversation, "answer": "5"}  # the chat stays, for an agent app


def test_a_streaming_dataset_is_read_batch_by_batch_and_reshuffled_each_epoch(tmp_path: Path) -> None:
    tasks = _load(_write(tmp_path, ".jsonl"), tmp_path, streaming=True, buffer_size=8)  # (parquet streams sleep 5 s)
    assert isinstance(tasks, StreamingDatasetTasks)
    config = SourceStage.Config(groups_per_batch=2, repeat=2, shuffle_seed=3)
    source = SourceStage(config, tasks=tasks)
    assert source.num_batches is None  # a stream's length shows only as it is read
    batches = list(source.batches())
    assert [len(batch) for batch in batches] == [2, 2, 2, 2, 2]
    prompts = [bytes(p.prompt_tokens).decode() for batch in batches for p in batch]
    first, second = prompts[:5], prompts[5:]
    assert Counter(first) == Counter(second) == Counter(ROWS["question"]) and first != second
    assert prompts == [bytes(p.prompt_tokens).decode() for p in SourceStage(config, tasks=tasks).submissions()]
    in_order = SourceStage(SourceStage.Config(groups_per_batch=2), tasks=tasks).submissions()
    assert [bytes(p.prompt_tokens).decode() for p in in_order] == ROWS["question"]


def test_a_stream_with_a_batch_limit_runs_epoch_after_epoch(tmp_path: Path) -> None:
    tasks = _load(_write(tmp_path, ".jsonl"), tmp_path, streaming=True)
    source = SourceStage(SourceStage.Config(groups_per_batch=4), tasks=tasks)
    source.limit_batches(3)
    assert source.num_batches == 3
    assert [len(batch) for batch in source.batches()] == [4, 4, 4]


def test_a_stream_needs_batches_of_a_known_size(tmp_path: Path) -> None:
    tasks = _load(_write(tmp_path, ".jsonl"), tmp_path, streaming=True)
    with pytest.raises(ConfigError, match="cannot put every group in one batch"):
        SourceStage(SourceStage.Config(), tasks=tasks)


def test_a_missing_column_is_named_with_the_datasets_columns(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no column 'query' \(columns.prompt\); its columns: question, solution"):
        _load(_write(tmp_path, ".parquet"), tmp_path, columns={"prompt": "query"})


def test_a_value_of_the_wrong_type_names_its_row(tmp_path: Path) -> None:
    path = _write(tmp_path, ".parquet", {"question": [7, 8], "solution": ["1", "2"]})
    with pytest.raises(
        ConfigError, match=r"row 0 \(prompt = column 'question', .*\): 'prompt' must be non-empty text, got 7"
    ):
        _load(path, tmp_path)


def test_an_empty_split_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"the split has no rows"):
        _load(_write(tmp_path, ".parquet", {"question": [], "solution": []}), tmp_path)
    features = datasets.Features({"question": datasets.Value("string"), "solution": datasets.Value("string")})
    empty = datasets.IterableDataset.from_generator(_no_rows, features=features)
    streamed = StreamingDatasetTasks(empty, _Rows("empty", {"prompt": "question"}, None, None), buffer_size=4)
    with pytest.raises(ConfigError, match=r"the split has no rows"):
        list(streamed.stream(0, None))


def _no_rows() -> Iterator[dict[str, str]]:
    yield from ()


def test_an_unknown_split_file_type_or_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot load the split 'test' of the dataset .*Unknown split"):
        _load(_write(tmp_path, ".csv"), tmp_path, split="test")
    (tmp_path / "tasks.txt").write_text("x", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"unknown file type '.txt'"):
        _load(tmp_path / "tasks.txt", tmp_path)
    with pytest.raises(ConfigError, match=r"no such file or folder"):
        _load(tmp_path / "nope.parquet", tmp_path)
    with pytest.raises(ConfigError, match=r"columns must map exactly one of prompt, messages, prompt_ids"):
        _load(_write(tmp_path, ".csv"), tmp_path, columns={"answer": "solution"})


def test_a_hub_id_that_cannot_be_reached_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read at import: the environment is too late
    with pytest.raises(ConfigError, match=r"cannot load the dataset 'nobody/no-such-set' from the Hugging Face hub"):
        _load("nobody/no-such-set", tmp_path)


def test_a_messages_prompt_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, ".jsonl", {"chat": [[{"role": "user", "content": "hi"}]]})
    with pytest.raises(ConfigError, match=r"row 0 .*a 'messages' prompt is rendered with a chat template"):
        _load(path, tmp_path, columns={"messages": "chat"})


def test_without_the_datasets_package_the_extra_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'thundersync\[data\]'"):
        _load(tmp_path / "x.parquet", tmp_path)
