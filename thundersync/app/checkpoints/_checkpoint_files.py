"""The files of a checkpoint directory: atomic publication, retention, and the model's weights (private).

A checkpoint is a directory ``step-NNNNNNNN`` in a run's checkpoint directory. It is filled under
a hidden temporary name in the same parent (``.step-NNNNNNNN.XXXX.tmp``), every file and the
directory are fsynced, then it is renamed into place and the parent is fsynced: a reader sees a
complete checkpoint or none. Its marker file :data:`MARKER` is written last, and only
directories that hold it count as checkpoints, so even a crash between the fsync and the rename
leaves nothing that :func:`find_checkpoint` would pick.

The weights are the model's own ``save_pretrained`` output (safetensors): full weights for a
transformers model, the adapter alone for a peft model. They load back with ``from_pretrained``
(``PeftModel.from_pretrained`` for an adapter) and, bitwise, into a live model with
:func:`load_weights`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import torch
from torch import nn

from thundersync.errors import ConfigError

__all__ = ["MARKER", "checkpoints", "find_checkpoint", "is_adapter", "load_weights", "prune", "publish", "save_weights"]

MARKER: Final = "checkpoint.json"
"""The file that makes a directory a checkpoint; written last."""

_NAME = re.compile(r"step-(\d+)")


def checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` as (step, path), oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.fullmatch(path.name)
        if match and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_checkpoint(path: Path) -> Path:
    """``path`` if it is a checkpoint, else the newest checkpoint in it; ConfigError if none."""
    if (path / MARKER).is_file():
        return path
    found = checkpoints(path)
    if not found:
        raise ConfigError(
            f"no checkpoint to resume from in {path}: it holds no {MARKER} and no step-N directory "
            f"with one; give a run's checkpoint directory or one of its step-N directories"
        )
    return found[-1][1]


def publish(target: Path, fill: Callable[[Path], None]) -> None:
    """Create the directory ``target`` atomically: ``fill`` writes it under a temporary name."""
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent))
    try:
        fill(temporary)
        for file in temporary.rglob("*"):
            if file.is_file():
                _fsync(file)
        _fsync(temporary)
        if target.exists():  # a checkpoint of the same step from an earlier run: replace it
            shutil.rmtree(target)
        temporary.rename(target)
        _fsync(parent)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def prune(directory: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints in ``directory``."""
    for _, path in checkpoints(directory)[:-keep]:
        shutil.rmtree(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_adapter(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (its checkpoint holds the adapter alone)."""
    return getattr(model, "peft_config", None) is not None


def save_weights(model: nn.Module, directory: Path) -> None:
    """``model.save_pretrained`` into ``directory`` as safetensors (adapter alone for peft)."""
    save = getattr(model, "save_pretrained", None)
    if save is None:
        raise ConfigError(
            f"cannot checkpoint a {type(model).__name__}: it has no save_pretrained; give the "
            "checkpointer a transformers model or a peft model"
        )
    with _quiet_progress():  # transformers' "Writing model shards" bar would cut the live line
        if is_adapter(model):
            save(str(directory), safe_serialization=True)
        else:
            save(str(directory))  # transformers writes safetensors only


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers' progress bars off for the block, as they were afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated


def load_weights(model: nn.Module, directory: Path) -> None:
    """Copy the weights saved in ``directory`` into ``model``, in place and bitwise."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"the checkpoint {directory} holds no .safetensors weights; it is incomplete")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    if is_adapter(model):
        from peft import set_peft_model_state_dict

        loaded = set_peft_model_state_dict(model, state)
        unexpected = list(getattr(loaded, "unexpected_keys", []))  # peft types it as an untyped namedtuple
    else:
        result = model.load_state_dict(state, strict=False)
        unexpected = list(result.unexpected_keys)
        _require_tied(model, state, list(result.missing_keys), directory)
    if unexpected:
        raise ConfigError(
            f"the checkpoint {directory} holds weights the model does not have ({', '.join(unexpected[:5])}); "
            "resume with the model the checkpoint was written from"
        )


def _require_tied(model: nn.Module, state: dict[str, torch.Tensor], missing: list[str], directory: Path) -> None:
    """Weights absent from a full checkpoint must be tied to saved ones (``save_pretrained`` drops those)."""
    own = model.state_dict()
    saved = {own[name].data_ptr() for name in state if name in own}
    untied = [name for name in missing if own[name].data_ptr() not in saved]
    if untied:
        raise ConfigError(
            f"the checkpoint {directory} lacks weights of the model ({', '.join(untied[:5])}); "
            "resume with the model the checkpoint was written from"
        )
