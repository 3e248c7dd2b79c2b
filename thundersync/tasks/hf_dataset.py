"""Tasks from a Hugging Face dataset: the ``dataset`` factory of pipeline files (``pip install 'thundersync[data]'``).

::

    [objects.tasks]
    factory = "dataset"
    path = "data/train.parquet"     # a .parquet/.json/.jsonl/.csv/.arrow file, a folder of them,
                                    # a dataset saved with save_to_disk, or a hub id (when reachable)
    split = "train"                 # slices too: "train[:90%]"
    columns = { prompt = "question", answer = "solution", level = "difficulty" }
    streaming = false               # true: read lazily, shuffled in a buffer, for large sets
    tokenizer = { object = "tokenizer" }
    chat = { object = "chat" }      # render prompt/messages with the chat template

Each row becomes a record and then a task (:func:`~thundersync.tasks.data.record_task`):
``columns`` maps the record's keys to the dataset's columns, ``prompt`` (text), ``messages`` (a
chat) or ``prompt_ids`` (token ids) for the prompt and any other key for a task field (``answer``
for :class:`~thundersync.tasks.AnswerReward`); without ``columns`` every column is taken under its
own name. A missing column, a value of the wrong type (naming the row) and an empty split fail
when the object is built.

A map-style dataset is converted whole (:class:`DatasetTasks`, a
:class:`~thundersync.tasks.TaskSource`: the source stage shuffles it by its ``shuffle_seed`` and
repeats it for epochs). ``streaming = true`` gives a :class:`StreamingDatasetTasks`, a
:class:`~thundersync.tasks.TaskStream`: rows are read as batches are needed, each epoch shuffled
by ``datasets``' buffer shuffle (``buffer_size`` rows) under the source's seed and the epoch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec

from thundersync.errors import ConfigError, MissingExtraError
from thundersync.sandboxes.output import Tokenizer
from thundersync.tasks.data import PROMPT_KEYS, Task, record_task
from thundersync.tools.base import ByteTokenizer
from thundersync.tools.chat_template import ChatTemplate

__all__ = ["DatasetTasks", "StreamingDatasetTasks", "dataset_tasks"]

_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
_SAVED = ("state.json", "dataset_dict.json")


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as error:
        raise MissingExtraError("the dataset factory", "data", "datasets") from error
    return datasets


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """``datasets`` without its progress bars (the library prints nothing), restored after."""
    shown = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def load_split(
    path: str, *, split: str, name: str | None, streaming: bool, cache_dir: str | None, revision: str | None
) -> Any:
    """The ``split`` of the dataset at ``path`` (see the module docstring), a ``Dataset`` or, with
    ``streaming``, an ``IterableDataset``."""
    datasets = _datasets()
    local = Path(path)
    with _quiet(datasets):
        try:
            if local.is_dir() and any((local / marker).is_file() for marker in _SAVED):
                loaded = _saved(datasets, local, split)
                return loaded.to_iterable_dataset() if streaming else loaded
            if local.is_file() and local.suffix not in _BUILDERS:
                raise ConfigError(
                    f"dataset {path}: unknown file type {local.suffix!r}; give a {', '.join(_BUILDERS)} file or a folder"
                )
            builder, files = (_BUILDERS[local.suffix], str(local)) if local.is_file() else (path, None)
            if not local.exists() and (path.startswith((".", "/", "~")) or local.suffix in _BUILDERS):
                raise ConfigError(f"dataset {path}: no such file or folder; give a local file, a folder or a hub id")
            return datasets.load_dataset(
                builder,
                name,
                data_files=files,
                split=split,
                streaming=streaming,
                cache_dir=cache_dir,
                revision=revision,
            )
        except ConfigError:
            raise
        except Exception as error:
            raise _load_error(path, split, local.exists(), error) from None


def _saved(datasets: Any, folder: Path, split: str) -> Any:
    loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"dataset {folder}: no split {split!r}; its splits: {', '.join(loaded)}")
        return loaded[split]
    return loaded  # a saved Dataset is one split: used whole


def _load_error(path: str, split: str, local: bool, error: Exception) -> ConfigError:
    detail = f"{type(error).__name__}: {str(error)[:300]}"
    if "corresponds to no data" in str(error):
        return ConfigError(f"dataset {path} (split {split!r}): the split has no rows; give a split with rows")
    if local:
        return ConfigError(f"cannot load the split {split!r} of the dataset {path}: {detail}")
    return ConfigError(
        f"cannot load the dataset {path!r} from the Hugging Face hub ({detail}); give a local file, a folder or "
        "a dataset saved with save_to_disk, or make the hub reachable"
    )


class _Rows:
    """Turns a dataset's rows into tasks: the column mapping, the checks, the tokenizer or template."""

    def __init__(
        self, label: str, columns: Mapping[str, str] | None, tokenizer: Tokenizer | None, chat: ChatTemplate | None
    ) -> None:
        if columns is not None and sum(key in PROMPT_KEYS for key in columns) != 1:
            raise ConfigError(
                f"dataset {label}: columns must map exactly one of {', '.join(PROMPT_KEYS)} to a column, "
                f"got {dict(columns)}"
            )
        self.label, self.columns = label, None if columns is None else dict(columns)
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.chat = chat

    def check_columns(self, names: list[str] | None) -> None:
        """Every mapped column is one of the dataset's ``names`` (None: not known before a row is read)."""
        if names is None or self.columns is None:
            return
        for key, column in self.columns.items():
            if column not in names:
                raise ConfigError(
                    f"dataset {self.label}: no column {column!r} (columns.{key}); its columns: {', '.join(names)}"
                )

    def task(self, index: int, row: Mapping[str, Any]) -> Task:
        where = f"dataset {self.label} row {index}"
        if self.columns is None:
            record = dict(row)
        else:
            self.check_columns(list(row))
            record = {key: row[column] for key, column in self.columns.items()}
            where += " (" + ", ".join(f"{key} = column {column!r}" for key, column in self.columns.items()) + ")"
        task = record_task(record, where, tokenizer=self.tokenizer, chat=self.chat)
        try:
            msgspec.json.encode(task.fields)
        except (TypeError, msgspec.EncodeError) as error:
            raise ConfigError(f"{where}: a task field is not a JSON value ({error}); map only plain columns") from None
        return task


class DatasetTasks:
    """The tasks of a map-style dataset split, converted when built (a :class:`~thundersync.tasks.TaskSource`)."""

    def __init__(self, dataset: Any, rows: _Rows) -> None:
        rows.check_columns(list(dataset.column_names))
        if len(dataset) == 0:
            raise ConfigError(f"dataset {rows.label}: the split has no rows; give a split with rows")
        self._tasks = [rows.task(index, row) for index, row in enumerate(dataset)]

    def tasks(self) -> list[Task]:
        return list(self._tasks)


class StreamingDatasetTasks:
    """The tasks of a streaming split, read lazily (a :class:`~thundersync.tasks.TaskStream`)."""

    def __init__(self, dataset: Any, rows: _Rows, *, buffer_size: int) -> None:
        rows.check_columns(None if dataset.column_names is None else list(dataset.column_names))
        self._dataset, self._rows, self.buffer_size = dataset, rows, buffer_size

    def stream(self, epoch: int, shuffle_seed: int | None) -> Iterator[Task]:
        dataset = self._dataset
        if shuffle_seed is not None:
            dataset = dataset.shuffle(seed=shuffle_seed, buffer_size=self.buffer_size)
        dataset.set_epoch(epoch)  # the buffer shuffle's seed is shuffle_seed + epoch
        empty = True
        for index, row in enumerate(dataset):
            empty = False
            yield self._rows.task(index, row)
        if empty and epoch == 0:
            raise ConfigError(f"dataset {self._rows.label}: the split has no rows; give a split with rows")


def dataset_tasks(
    *,
    path: str,
    split: str = "train",
    name: str | None = None,
    columns: dict[str, str] | None = None,
    streaming: bool = False,
    buffer_size: int = 1000,
    cache_dir: str | None = None,
    revision: str | None = None,
    tokenizer: Tokenizer | None = None,
    chat: ChatTemplate | None = None,
) -> DatasetTasks | StreamingDatasetTasks:
    """The ``dataset`` factory: the tasks of ``split`` of the dataset at ``path`` (module docstring).

    ``name``: the dataset's configuration (hub datasets); ``cache_dir``: where ``datasets``
    caches what it converts (default its own); ``revision``: a hub revision.
    """
    if buffer_size < 1:
        raise ConfigError(f"buffer_size is {buffer_size}; give the number of rows to shuffle in, >= 1")
    label = f"{path} (split {split!r})"
    rows = _Rows(label, columns, tokenizer, chat)
    loaded = load_split(path, split=split, name=name, streaming=streaming, cache_dir=cache_dir, revision=revision)
    if streaming:
        return StreamingDatasetTasks(loaded, rows, buffer_size=buffer_size)
    return DatasetTasks(loaded, rows)
