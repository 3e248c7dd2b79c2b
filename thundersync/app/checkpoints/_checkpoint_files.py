"""The files of a checkpoint directory: atomic publication, retention, and the model's weights (private).

A checkpoint is a directory ``step-NNNNNNNN`` in a run's checkpoint directory. It is filled under
a hidden temporary name in the same parent (``.step-NNNNNNNN.XXXX.tmp``), every file and the
directory are fsynced, then it is renamed into place and the parent is fsynced: a reader sees a
complete checkpoint or none. Its marker file :data:`MARKER` is written last, and only
directories that hold it count as checkpoints, so even a crash between the fsync and the rename
leaves nothing that :func:`~thundersync.app.checkpoints.run_directory.find_checkpoint` would pick.
A temporary left by a killed writer is removed at the run's next save (:func:`clean_temporaries`).
An existing ``step-N`` is replaced only when it is a checkpoint of the same run, and retention
(:func:`prune`) deletes only the run's own checkpoints: the ``keep_last`` newest and every
``keep_every``-th step stay.

The weights are the model's own ``save_pretrained`` output (safetensors): full weights for a
transformers model, the adapter alone for a peft model. They load back with ``from_pretrained``
(``PeftModel.from_pretrained`` for an adapter) and, bitwise, into a live model with
:func:`load_weights`, which opens only regular files and turns every failure into one
ConfigError naming the checkpoint and the file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from thundersync.app.checkpoints.run_directory import MARKER, Checkpoint, open_regular, read_info, scan
from thundersync.errors import ConfigError

__all__ = [
    "clean_temporaries",
    "complete",
    "is_adapter",
    "load_weights",
    "make_temporary",
    "prune",
    "publish",
    "retained",
    "save_weights",
]


def publish(target: Path, fill: Callable[[Path], None], run: str) -> None:
    """Create the directory ``target`` atomically: ``fill`` writes it under a temporary name. A
    ``target`` already there is replaced only when it is a checkpoint of ``run``."""
    temporary = make_temporary(target)
    try:
        fill(temporary)
        complete(temporary, target, run)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def make_temporary(target: Path) -> Path:
    """A new, empty temporary directory for ``target`` in its parent (``.step-N.XXXX.tmp``)."""
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent))


def complete(temporary: Path, target: Path, run: str) -> None:
    """Fsync every file of the filled ``temporary`` and the directories, then rename it to
    ``target`` (replacing only a checkpoint of ``run``) and fsync the parent."""
    for path in temporary.rglob("*"):
        if path.is_file() or path.is_dir():
            _fsync(path)
    _fsync(temporary)
    if os.path.lexists(target):  # a checkpoint of the same step, from this run before a resume
        _require_own(target, run)
        shutil.rmtree(target)
    temporary.rename(target)
    _fsync(target.parent)


def _require_own(target: Path, run: str) -> None:
    """ConfigError unless ``target`` is a checkpoint directory of ``run`` (never replace another's)."""
    if os.path.islink(target) or not target.is_dir() or not os.path.lexists(target / MARKER):
        raise ConfigError(
            f"cannot save the checkpoint {target}: something not written by a checkpointer is in its place "
            f"(no directory with a {MARKER}), and it is never replaced; move or delete it yourself"
        )
    if read_info(target).run != run:
        raise ConfigError(
            f"cannot save the checkpoint {target}: a checkpoint of another run is in its place and is never "
            "replaced; give the checkpointer another directory, or start with --overwrite"
        )


def clean_temporaries(directory: Path) -> None:
    """Remove the temporary directories a killed writer left in ``directory`` (``.step-N.*.tmp``)."""
    for path in scan(directory).temporaries:
        shutil.rmtree(path, ignore_errors=True)


def retained(found: list[Checkpoint], keep_last: int, keep_every: int) -> list[Checkpoint]:
    """Which of one run's checkpoints (oldest first) retention keeps: the ``keep_last`` newest (so
    always the newest, the final one of a finished run) and each whose step is a multiple of
    ``keep_every`` (0: none)."""
    newest = found[-keep_last:]
    return [c for c in found if c in newest or (keep_every and c.step % keep_every == 0)]


def prune(directory: Path, run: str, keep_last: int, keep_every: int = 0) -> None:
    """Delete the checkpoints of ``run`` in ``directory`` that retention does not keep; nothing else."""
    found = scan(directory).of_run(run)
    kept = retained(found, keep_last, keep_every)
    for checkpoint in found:
        if checkpoint not in kept:
            shutil.rmtree(checkpoint.path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_adapter(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (its checkpoint holds the adapter alone)."""
    return getattr(model, "peft_config", None) is not None


def save_weights(model: nn.Module, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """``model.save_pretrained`` into ``directory`` as safetensors (adapter alone for peft); with
    ``state_dict``, that state (a sharded model's, gathered) instead of the model's own."""
    save = getattr(model, "save_pretrained", None)
    if save is None:
        raise ConfigError(
            f"cannot checkpoint a {type(model).__name__}: it has no save_pretrained; give the "
            "checkpointer a transformers model or a peft model"
        )
    given = {} if state_dict is None else {"state_dict": state_dict}
    with _quiet_progress():  # transformers' "Writing model shards" bar would cut the live line
        if is_adapter(model):
            save(str(directory), safe_serialization=True, **given)
        else:
            save(str(directory), **given)  # transformers writes safetensors only
    if state_dict is not None:
        _unsharded_architecture(model, directory)


def _unsharded_architecture(model: nn.Module, directory: Path) -> None:
    """``fully_shard`` makes the model's class ``FSDP<Class>``, which ``save_pretrained`` records
    in ``config.json``'s ``architectures``: record the class it was made from."""
    import json

    config = directory / "config.json"
    if not config.is_file():  # an adapter's directory has no model config
        return
    from torch.distributed.fsdp import FSDPModule

    plain = next((c.__name__ for c in type(model).__mro__ if not issubclass(c, FSDPModule)), None)
    data = json.loads(config.read_text())
    if plain is not None and isinstance(data.get("architectures"), list):
        data["architectures"] = [plain]
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


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
    """Copy the weights saved in ``directory`` into ``model``, in place and bitwise; ConfigError
    naming the checkpoint and the file for anything that does not read or fit."""
    state = _read_weights(directory)
    try:
        if is_adapter(model):
            from peft import set_peft_model_state_dict

            loaded = set_peft_model_state_dict(model, state)
            unexpected = list(getattr(loaded, "unexpected_keys", []))  # peft types it as an untyped namedtuple
        else:
            result = model.load_state_dict(state, strict=False)
            unexpected = list(result.unexpected_keys)
            _require_tied(model, state, list(result.missing_keys), directory)
    except (RuntimeError, ValueError, KeyError) as error:  # shapes that do not fit, mostly
        raise ConfigError(
            f"the checkpoint {directory}: its weights do not fit the model: {_first_line(error)}; "
            "resume with the model the checkpoint was written from"
        ) from None
    if unexpected:
        raise ConfigError(
            f"the checkpoint {directory} holds weights the model does not have ({', '.join(unexpected[:5])}); "
            "resume with the model the checkpoint was written from"
        )


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of every ``*.safetensors`` file of ``directory`` (regular files only)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"the checkpoint {directory} holds no .safetensors weights; it is incomplete")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            fd = open_regular(file)
        except ConfigError as error:
            raise ConfigError(f"the checkpoint {directory}: {error}; it is damaged") from None
        try:
            state.update(load_file(f"/dev/fd/{fd}"))  # the very file checked, mapped (no copy)
        except Exception as error:  # safetensors raises its own SafetensorError, and OSError
            raise ConfigError(
                f"the checkpoint {directory}: {file.name} is not a readable safetensors file "
                f"({_first_line(error)}); it is damaged or incomplete"
            ) from None
        finally:
            os.close(fd)
    return state


def _first_line(error: BaseException) -> str:
    """The error's message on one line (torch's span several), at most 300 characters."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


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
