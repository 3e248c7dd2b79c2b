"""A checkpoint directory belongs to one run: its run marker, its checkpoints' validated records,
and :func:`preflight`, the checks a run makes before it builds anything. No torch here.

A run's checkpoint directory ``DIR``::

    run.json                   {"format": 1, "run": "<32 hex digits>"}: the run that owns DIR,
                               written when that run first saves
    step-00000020/checkpoint.json   {"format": 2, "run": ..., "step": 20, ...}: a checkpoint, its
                               run recorded too; only the checkpoints of DIR's run count

A checkpoint is one of DIR's run's when its ``checkpoint.json`` names that run; "the newest
checkpoint of DIR" is the one of highest step among those. A run writes, replaces and deletes only
its own checkpoints, and never a ``step-N`` without a ``checkpoint.json`` (not written by a
checkpointer, or incomplete): that is refused, never deleted. Every ``checkpoint.json`` and
``run.json`` is read from a regular file only (opened with ``O_NOFOLLOW | O_NONBLOCK`` and
checked with ``fstat``: a link, FIFO or device in its place is an error, never a hang) and
decoded into a typed msgspec Struct (required keys, types, ``0 <= step <= 10**12``). Every
refusal is a :class:`~thundersync.errors.ConfigError` naming the path, what is wrong and what to do.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Final, Literal

import msgspec

from thundersync.app.paths import file_kind
from thundersync.errors import ConfigError
from thundersync.events import Id

__all__ = [
    "FORMAT",
    "MARKER",
    "MAX_STEP",
    "RUN_FILE",
    "Checkpoint",
    "CheckpointInfo",
    "Preflight",
    "RunMarker",
    "find_checkpoint",
    "model_directory",
    "new_run_id",
    "open_regular",
    "preflight",
    "read_info",
    "read_run",
    "scan",
    "write_atomically",
    "write_run",
]

FORMAT: Final = 2
"""The version of the checkpoint layout, recorded in ``checkpoint.json`` (2: each records its run)."""

MARKER: Final = "checkpoint.json"
"""The file that makes a directory a checkpoint; written last."""

RUN_FILE: Final = "run.json"
"""The file that names the run owning a checkpoint directory."""

MAX_STEP: Final = 10**12
"""The largest step a ``checkpoint.json`` may record."""

_MAX_JSON: Final = 1 << 28  # bytes: a marker past this is not one this library wrote
_NAME = re.compile(r"step-(\d+)")
_TEMPORARY = re.compile(r"\.step-\d+\..+\.tmp")  # publish's mkdtemp names

RunId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]


class RunMarker(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``run.json``: the run that owns a checkpoint directory."""

    format: Literal[1]
    run: RunId


class CheckpointInfo(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    """``checkpoint.json``: the run and step of a checkpoint, what its weights are, its data
    position, and its layout: ``files`` (the model's safetensors and ``training_state.pt``, left
    out of the file) or ``distributed`` (model and optimizer in ``distributed/``, written by every
    rank of a sharded run through ``torch.distributed.checkpoint``)."""

    format: int
    run: RunId
    step: Annotated[int, msgspec.Meta(ge=0, le=MAX_STEP)]
    weights: Literal["full", "adapter"]
    consumed_batches: list[Id]
    layout: Literal["files", "distributed"] = "files"


class _Format(msgspec.Struct):
    format: object = None


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its directory and its validated ``checkpoint.json``."""

    path: Path
    info: CheckpointInfo

    @property
    def step(self) -> int:
        return self.info.step


def new_run_id() -> str:
    """A fresh run id (32 hex digits)."""
    return uuid.uuid4().hex


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path``; ConfigError for a link, FIFO, device,
    directory or a missing file (never blocks: ``O_NONBLOCK`` until ``fstat`` has said "regular")."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as error:
        kind = _kind_at(path)
        what = f"is a {kind}, not a regular file" if kind not in (None, "regular file") else error.strerror
        raise ConfigError(f"cannot read {path}: it {what}" if kind else f"cannot read {path}: {what}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ConfigError(f"cannot read {path}: it is a {file_kind(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def _read_regular(path: Path) -> bytes:
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as file:
        data = file.read(_MAX_JSON + 1)
    if len(data) > _MAX_JSON:
        raise ConfigError(f"cannot read {path}: it is larger than {_MAX_JSON} bytes")
    return data


def read_info(checkpoint: Path) -> CheckpointInfo:
    """The validated ``checkpoint.json`` of the directory ``checkpoint``."""
    path = checkpoint / MARKER
    try:
        data = _read_regular(path)
        version = msgspec.json.decode(data, type=_Format).format
        if version == FORMAT:
            return msgspec.json.decode(data, type=CheckpointInfo)
    except (ConfigError, msgspec.DecodeError) as error:
        raise ConfigError(
            f"the checkpoint {checkpoint} is not valid: {MARKER}: {_without_path(error, path)}; "
            "give a checkpoint written by thundersync's checkpointer"
        ) from None
    raise ConfigError(
        f"the checkpoint {checkpoint} has format {version!r} (another version of thundersync wrote it); "
        f"this version reads format {FORMAT}: resume it with the version that wrote it, or move it away"
    )


def read_run(directory: Path) -> str | None:
    """The run that owns ``directory`` (its ``run.json``; None when there is none)."""
    path = directory / RUN_FILE
    if _kind_at(path) is None:
        return None
    try:
        return msgspec.json.decode(_read_regular(path), type=RunMarker).run
    except (ConfigError, msgspec.DecodeError) as error:
        raise ConfigError(
            f"the checkpoint directory {directory} has an invalid {RUN_FILE}: {_without_path(error, path)}; "
            "it was not written by thundersync's checkpointer: give the checkpointer another directory"
        ) from None


def write_run(directory: Path, run: str) -> None:
    """Record ``run`` as the owner of ``directory`` (atomically: a temporary file renamed into place)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_atomically(directory / RUN_FILE, msgspec.json.encode(RunMarker(format=1, run=run)) + b"\n", tag=run)


def write_atomically(path: Path, data: bytes, *, tag: str) -> None:
    """Write ``data`` as ``path``: into ``.NAME.TAG.tmp`` beside it, created exclusively and never
    through a link, synced, then renamed over ``path``; on failure the temporary file is removed,
    so a reader sees the old file or the whole new one, never part of it."""
    temporary = path.parent / f".{path.name}.{tag}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class DirectoryState:
    """What a checkpoint directory holds (see :func:`scan`)."""

    run: str | None
    checkpoints: list[Checkpoint] = field(default_factory=list)  # every complete one, oldest first
    unmarked: list[Path] = field(default_factory=list)  # step-N that are no checkpoint: never deleted
    temporaries: list[Path] = field(default_factory=list)  # left by a killed writer

    def of_run(self, run: str | None) -> list[Checkpoint]:
        return [c for c in self.checkpoints if c.info.run == run]


def scan(directory: Path) -> DirectoryState:
    """The run, checkpoints (validated), unmarked ``step-N`` entries and temporaries of ``directory``."""
    if not directory.is_dir():
        return DirectoryState(run=None)
    state = DirectoryState(run=read_run(directory))
    for path in sorted(directory.iterdir()):
        kind = _kind_at(path)
        if _TEMPORARY.fullmatch(path.name) and kind == "directory":
            state.temporaries.append(path)
        elif _NAME.fullmatch(path.name):
            if kind == "directory" and _kind_at(path / MARKER) is not None:
                state.checkpoints.append(Checkpoint(path, read_info(path)))
            else:
                state.unmarked.append(path)
    state.checkpoints.sort(key=lambda c: (c.step, c.path.name))
    return state


def find_checkpoint(path: Path) -> Checkpoint:
    """``path`` if it is a checkpoint, else the newest checkpoint of the run that owns the directory ``path``."""
    if path.is_dir() and _kind_at(path / MARKER) is not None:
        return Checkpoint(path, read_info(path))
    state = scan(path)
    if state.run is None and state.checkpoints:
        raise ConfigError(
            f"{path} holds checkpoints but no {RUN_FILE} naming the run they belong to (written by an older "
            f"thundersync, or copied together); give one checkpoint, e.g. {state.checkpoints[-1].path}"
        )
    found = state.of_run(state.run)
    if not found:
        raise ConfigError(
            f"no checkpoint to resume from in {path}: it holds no {MARKER} and no step-N directory "
            f"with one of its run; give a run's checkpoint directory or one of its step-N directories"
        )
    return found[-1]


def model_directory(path: Path) -> Path:
    """``path`` if it holds a model (``config.json``), else the newest checkpoint of full weights
    of the run that owns the checkpoint directory ``path`` (``run.json``): what a teacher ``path``
    names. ConfigError when there is none."""
    if (path / "config.json").is_file():
        return path
    state = scan(path)
    found = [c for c in state.of_run(state.run) if c.info.weights == "full" and (c.path / "config.json").is_file()]
    if state.run is None or not found:
        raise ConfigError(
            f"the teacher path {str(path)!r} is not a model directory (no config.json) and holds no checkpoint "
            f"of full weights of its run (no {RUN_FILE} and step-N/{MARKER} of that run); save a model there, "
            "or train the teacher first (thundersync run examples/agent_grpo.toml writes runs/agent_grpo)"
        )
    return found[-1].path


@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` found: the run the checkpointer continues (None: a new one) and
    what ``--overwrite`` removes (:meth:`apply`; :attr:`message` says what, in one line)."""

    directory: Path
    run: str | None
    removes: tuple[Path, ...] = ()

    @property
    def message(self) -> str:
        names = ", ".join(path.name for path in self.removes)
        return f"--overwrite: removing from the checkpoint directory {self.directory}: {names}"

    def apply(self) -> None:
        """Remove :attr:`removes` (checkpoints, ``run.json``, temporaries; never following a link)."""
        for path in self.removes:
            if _kind_at(path) == "directory":
                shutil.rmtree(path)  # fd-based on Linux: never follows a link inside
            elif _kind_at(path) is not None:
                path.unlink()


def preflight(directory: Path, *, resume: Path | None = None, overwrite: bool = False) -> Preflight:
    """Check that a run may write its checkpoints to ``directory`` before anything is built.

    ``resume``: what ``--resume`` names (a checkpoint, or a run's directory); its checkpoint is
    validated now. Resuming a checkpoint of ``directory``'s own run continues that run; the rest
    starts a new run, which needs ``directory`` free of checkpoints, or ``overwrite`` to remove
    them (and the earlier ``run.json``, and temporaries). ``step-N`` entries without a
    ``checkpoint.json`` are refused in every case. Removes nothing itself: see :meth:`Preflight.apply`.
    """
    state = scan(directory)
    if state.unmarked:
        raise ConfigError(
            f"the checkpoint directory {directory} holds {state.unmarked[0].name}, which has no {MARKER}: "
            "it was not written by a checkpointer (or is incomplete) and is never deleted or replaced; "
            "move or delete it yourself, or give the checkpointer another directory"
        )
    continued = _continued(directory, state, resume)
    own = state.of_run(continued.info.run) if continued is not None else []
    later = [c for c in own if continued is not None and c.step > continued.step]
    others = [c for c in state.checkpoints if c not in own]
    removes = [c.path for c in (*others, *later)]
    if removes and not overwrite:
        raise ConfigError(_refusal(directory, continued, others, later))
    if overwrite and continued is None and state.run is not None:
        removes.append(directory / RUN_FILE)
    removes += state.temporaries if overwrite else []
    return Preflight(directory, None if continued is None else continued.info.run, tuple(removes))


def _continued(directory: Path, state: DirectoryState, resume: Path | None) -> Checkpoint | None:
    """The checkpoint ``resume`` names when it is one of ``directory``'s run (None otherwise)."""
    if resume is None:
        return None
    checkpoint = find_checkpoint(resume)
    inside = directory.is_dir() and os.path.samefile(checkpoint.path.parent, directory)
    if not inside:
        return None
    if state.run is None:
        raise ConfigError(
            f"--resume {resume}: {directory} has no {RUN_FILE} naming the run its checkpoints belong to; "
            "copy the checkpoint to resume from elsewhere and resume from there, or give the checkpointer "
            "another directory"
        )
    if checkpoint.info.run != state.run:
        raise ConfigError(
            f"--resume {resume}: the checkpoint {checkpoint.path} is not of the run that owns {directory} "
            f"(its {RUN_FILE}); resume from {directory} itself, or give the checkpointer another directory"
        )
    return checkpoint


def _refusal(directory: Path, continued: Checkpoint | None, others: list[Checkpoint], later: list[Checkpoint]) -> str:
    if continued is not None and later:
        steps = ", ".join(str(c.step) for c in later)
        return (
            f"--resume {continued.path} continues from step {continued.step}, but {directory} holds later "
            f"checkpoints of the same run (steps {steps}) that the resumed run would mix with its own; "
            f"resume from the newest (--resume {directory}), or add --overwrite to remove the later ones"
        )
    steps = ", ".join(str(c.step) for c in others)
    return (
        f"the checkpoint directory {directory} holds checkpoints of another run (steps {steps}), which this "
        f"run would mix with its own; continue that run with --resume {directory}, replace them with "
        "--overwrite, or give the checkpointer another directory"
    )


def _kind_at(path: Path) -> str | None:
    """What ``path`` is, not following a link (None: nothing is there)."""
    try:
        return file_kind(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None


def _without_path(error: Exception, path: Path) -> str:
    """An error's message without the ``cannot read PATH: `` that the context already says."""
    return str(error).removeprefix(f"cannot read {path}: ")
