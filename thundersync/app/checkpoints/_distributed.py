"""A checkpoint's distributed layout (private): the model's and optimizer's state through
``torch.distributed.checkpoint`` (DCP), every rank writing its own shards.

A sharded run (``[run] shard = true``) keeps its model and optimizer state in ``step-N/distributed/``
(DCP's ``.metadata`` and one ``__R_0.distcp`` per writing rank); the rest of the checkpoint is
the files layout's (``training_state.pt`` without the optimizer, ``checkpoint.json``, and with
``consolidated`` the whole model's safetensors). The state dicts are
``torch.distributed.checkpoint.state_dict``'s (keyed by parameter names, optimizer state
included), so a checkpoint saved on N ranks loads on M, one process without a process group
included. Reading trusts nothing the directory says: ``distributed`` must be a directory (not a
link), every file is opened with ``O_NOFOLLOW`` and must be regular (:func:`open_regular`), the
files the metadata names must be plain names in that directory, and ``.metadata`` (a pickle) is
unpickled with only DCP's own metadata classes, torch's sizes and dtypes and ``pathlib`` paths
allowed, never arbitrary code.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter

from thundersync.app.checkpoints.run_directory import open_regular
from thundersync.engine.sharded import ShardedDataParallel
from thundersync.errors import ConfigError, DistributedError

__all__ = ["DISTRIBUTED", "load_distributed", "save_distributed"]

DISTRIBUTED: Final = "distributed"
"""The DCP directory inside a checkpoint of the distributed layout."""

_ALLOWED_TORCH: Final = frozenset({"Size", "device"}) | frozenset(
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
)


def save_distributed(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sharded: ShardedDataParallel | None
) -> None:
    """Every rank: write its part of ``model``'s and ``optimizer``'s state at ``path`` (a new DCP
    directory); one process without a sharded model writes the whole state."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.api import CheckpointException

    writer = FileSystemWriter(path, sync_files=True)
    try:
        if sharded is not None:
            sharded.save(path, optimizer, storage_writer=writer)
            return
        with _one_process():
            state_dict_saver.save(_state(model, optimizer), storage_writer=writer, no_dist=True)
    except CheckpointException as error:  # a BaseException: the ranks that failed and why
        raise DistributedError(f"the checkpoint's distributed state was not written: {_failures(error)}") from None


def load_distributed(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sharded: ShardedDataParallel | None
) -> None:
    """Every rank: read what :func:`save_distributed` wrote at ``path`` (on any number of ranks)
    into ``model`` and ``optimizer``; ConfigError naming the checkpoint for a file that is
    missing, not regular, or does not fit."""
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    checkpoint = path.parent
    _require_directory(path, checkpoint)
    reader = _CheckedReader(path)
    try:
        if sharded is not None:
            sharded.load(path, optimizer, storage_reader=reader)
            return
        state = _state(model, optimizer)
        with _one_process():
            state_dict_loader.load(state, storage_reader=reader, no_dist=True)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    except ConfigError as error:
        raise ConfigError(f"the checkpoint {checkpoint}: {error}; it is damaged") from None
    except CheckpointException as error:  # a BaseException: each failed rank's exception
        first = next(iter(error.failures.values()))[0]
        if isinstance(first, ConfigError):
            raise ConfigError(f"the checkpoint {checkpoint}: {first}; it is damaged") from None
        raise ConfigError(
            f"the checkpoint {checkpoint}: its {DISTRIBUTED}/ state does not load into this run's model and "
            f"optimizer ({_failures(error)}); resume with the objects the checkpoint was written from"
        ) from None
    except Exception as error:
        raise ConfigError(
            f"the checkpoint {checkpoint}: its {DISTRIBUTED}/ state does not load into this run's model and "
            f"optimizer ({_first_line(error)}); resume with the objects the checkpoint was written from"
        ) from None


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP without a process group warns that it assumes one process, which is what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def _require_directory(path: Path, checkpoint: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(
            f"the checkpoint {checkpoint} records the distributed layout but has no {DISTRIBUTED}/ directory; "
            "it is incomplete"
        ) from None
    if not stat.S_ISDIR(mode):
        raise ConfigError(f"the checkpoint {checkpoint}: {DISTRIBUTED} is not a directory (a link?); it is damaged")


def _failures(error: Any) -> str:
    """A CheckpointException's failures, one per rank: ``rank R: Type: first line``."""
    items = sorted(error.failures.items())
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {_first_line(exc)}" for rank, (exc, _) in items)


def _first_line(error: BaseException) -> str:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class _RegularFiles(FileSystem):
    """DCP's local file system, reading regular files only, never through a link."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise ConfigError(f"a checkpoint being read is never written ({path}, mode {mode!r})")
        with os.fdopen(open_regular(Path(path)), "rb") as stream:
            yield stream


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata``: its own dataclasses, torch's sizes and dtypes, paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and name in _ALLOWED_TORCH)
            or (module, name) in {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}
            or (module, name) in {("collections", "OrderedDict"), ("builtins", "set")}
        )
        if not allowed:
            raise ConfigError(f"{DISTRIBUTED}/.metadata names {module}.{name}, which DCP's metadata never holds")
        return super().find_class(module, name)


class _CheckedReader(FileSystemReader):
    """A ``FileSystemReader`` that opens regular files only, unpickles the metadata restricted,
    and reads only plain file names of its own directory."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fs = _RegularFiles()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with self.fs.create_stream(Path(self.path) / name, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except ConfigError:
                raise
            except Exception as error:
                raise ConfigError(f"{DISTRIBUTED}/{name} does not read ({_first_line(error)})") from None
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"{DISTRIBUTED}/{name} holds a {type(metadata).__name__}, not DCP's Metadata")
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        for info in (metadata.storage_data or {}).values():
            relative = str(getattr(info, "relative_path", ""))
            if not relative or relative != os.path.basename(relative) or relative in (".", ".."):
                raise ConfigError(f"{DISTRIBUTED}/{name} names the file {relative!r}, not a file of its directory")
        return metadata


def require_shards(path: Path) -> None:
    """ConfigError unless every file the metadata at ``path`` names is a regular file there (on
    the writer, after every rank wrote: the ranks must share the checkpoint directory)."""
    metadata = _CheckedReader(path).read_metadata()
    names = sorted({str(info.relative_path) for info in (metadata.storage_data or {}).values()})
    missing = [name for name in names if not (path / name).is_file() or (path / name).is_symlink()]
    if missing:
        raise ConfigError(
            f"the checkpoint being written in {path.parent} lacks {', '.join(missing[:3])}, which other ranks "
            "wrote: every rank writes its shards to the checkpoint directory, which must be the same directory "
            "(a shared file system) on every node"
        )


def save_consolidated(model: nn.Module, full: dict[str, torch.Tensor], path: Path) -> None:
    """The writer: ``full`` (the whole model's state, gathered) as the files layout's weights in
    ``path``: ``save_pretrained`` with that state dict (a peft model writes its adapter alone)."""
    from thundersync.app.checkpoints._checkpoint_files import save_weights

    save_weights(model, path, state_dict=full)
