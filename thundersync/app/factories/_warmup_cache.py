"""The warm-up's cache: a warmed-up model's weights kept in a directory, found again by what made them.

A warm-up is a function of its inputs (the model's starting weights, the demonstrations, the
hyper-parameters, which parameters it trains, the device type and the torch version), so a run
that repeats one, as every run of an agent file does, can load its result instead.
:func:`cache_key` hashes those inputs (the weights' bytes, not their names alone); the weights are
one safetensors file per key, ``<key>.safetensors`` in the cache directory.

A cache file is read only when it is a regular file, never through a link (the checkpoints'
``open_regular``), and written as the checkpoints' run marker is (``write_atomically``: a temporary
name created exclusively, renamed into place once whole), so a run stopped halfway leaves no file
that a later run would load, and runs sharing the directory never read a half-written one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from thundersync.app.checkpoints.run_directory import open_regular, write_atomically
from thundersync.errors import ConfigError
from thundersync.tasks.demonstrations import Demonstration

__all__ = ["cache_key", "load_cached", "save_cached"]

_FORMAT = b"thundersync-warmup-cache-1"


def cache_key(model: nn.Module, examples: list[Demonstration], settings: Mapping[str, object]) -> str:
    """The hex digest naming the warm-up of ``model`` (its weights now) on ``examples`` with
    ``settings`` (steps, batch size, learning rate...), on this device type and torch version."""
    digest = hashlib.sha256(_FORMAT)
    device = next(model.parameters()).device.type
    trained = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    digest.update(repr((sorted(settings.items()), device, torch.__version__, trained)).encode())
    for name, tensor in model.state_dict().items():
        digest.update(repr((name, str(tensor.dtype), tuple(tensor.shape))).encode())
        digest.update(tensor.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
    for example in examples:
        digest.update(repr((example.token_ids, example.written)).encode())
    return digest.hexdigest()


def load_cached(model: nn.Module, directory: Path, key: str) -> Path | None:
    """Load the cached result of warm-up ``key`` into ``model``; its file, or None when there is none."""
    from safetensors.torch import load_file

    path = directory / f"{key}.safetensors"
    if not os.path.lexists(path):
        return None
    try:
        fd = open_regular(path)
    except ConfigError as error:
        raise ConfigError(
            f"the warm-up cache file {path} cannot be read ({error}); remove it or give another cache"
        ) from None
    try:
        weights = load_file(f"/dev/fd/{fd}")  # the very file checked
    finally:
        os.close(fd)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        raise ConfigError(f"the warm-up cache file {path} does not fit the model ({error}); remove it") from error
    return path


def save_cached(model: nn.Module, directory: Path, key: str) -> Path:
    """Write ``model``'s weights as the result of warm-up ``key``; the file."""
    from safetensors.torch import save

    directory.mkdir(parents=True, exist_ok=True)
    # clones: tied weights share storage, which safetensors refuses; each key gets its own copy
    data = save({name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()})
    path = directory / f"{key}.safetensors"
    write_atomically(path, data, tag=str(os.getpid()))
    return path
