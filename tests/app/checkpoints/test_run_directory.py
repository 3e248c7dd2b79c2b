"""A checkpoint directory belongs to one run, and a checkpoint is validated before it is trusted.

Checkpoints here are saved directly (``Checkpointer.save``) from a tiny Qwen3; the runs through
``thundersync run`` are in tests/app/cli/test_checkpoint_runs.py.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.tiny_models import tiny_qwen3
from thundersync.app.checkpoints import find_checkpoint, preflight
from thundersync.app.checkpoints.checkpoint import STATE_FILE, Checkpointer
from thundersync.app.checkpoints.run_directory import MARKER, RUN_FILE, model_directory, read_run, scan
from thundersync.errors import ConfigError
from thundersync.pipeline.policy import PolicyClock


def _checkpointer(directory: Path, **options: int) -> Checkpointer:
    model = tiny_qwen3(seed=0)
    return Checkpointer(
        directory, model=model, optimizer=torch.optim.SGD(model.parameters()), policy=PolicyClock(), **options
    )


def _steps(directory: Path) -> list[int]:
    return [c.step for c in scan(directory).checkpoints]


@pytest.fixture
def alarm() -> Iterator[None]:
    """Fail a test that blocks (a FIFO opened for reading waits for a writer) instead of hanging."""

    def timeout(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError("blocked on a special file")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_new_run_never_deletes_or_prefers_an_earlier_runs_checkpoints(tmp_path: Path) -> None:
    old = _checkpointer(tmp_path)
    old.save(20)
    old.save(25)
    new = _checkpointer(tmp_path)
    with pytest.raises(
        ConfigError,
        match=rf"^the checkpoint directory {tmp_path} holds checkpoints of another run \(steps 20, 25\), which this "
        r"run would mix with its own; resume that run \(--resume\), remove them first \(--overwrite",
    ):
        new.save(10)
    assert _steps(tmp_path) == [20, 25]
    cleared = preflight(tmp_path, overwrite=True)
    assert [path.name for path in cleared.removes] == ["step-00000020", "step-00000025", RUN_FILE]
    cleared.apply()
    new.save(10)
    new.save(15)
    assert _steps(tmp_path) == [10, 15]
    assert find_checkpoint(tmp_path).path == tmp_path / "step-00000015"
    assert read_run(tmp_path) == new.run != old.run


def test_without_overwrite_or_resume_preflight_refuses_a_directory_with_another_runs_checkpoints(
    tmp_path: Path,
) -> None:
    _checkpointer(tmp_path).save(3)
    with pytest.raises(
        ConfigError,
        match=rf"^the checkpoint directory {tmp_path} holds checkpoints of another run \(steps 3\), which this run "
        rf"would mix with its own; continue that run with --resume {tmp_path}, replace them with --overwrite, or "
        r"give the checkpointer another directory$",
    ):
        preflight(tmp_path)
    assert preflight(tmp_path, resume=tmp_path).removes == ()  # continuing it is fine


def test_a_resumed_checkpointer_continues_the_run_and_prunes_only_its_own(tmp_path: Path) -> None:
    first = _checkpointer(tmp_path, keep_last=2)
    first.save(1)
    first.save(2)
    resumed = _checkpointer(tmp_path, keep_last=2)
    resumed.resume(tmp_path)
    assert resumed.run == first.run and resumed.saved_step == 2
    resumed.save(3)
    assert _steps(tmp_path) == [2, 3]


def test_resuming_an_older_checkpoint_of_the_run_needs_overwrite_to_drop_the_later_ones(tmp_path: Path) -> None:
    saver = _checkpointer(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        saver.save(step)
    older = tmp_path / "step-00000002"
    with pytest.raises(ConfigError, match=r"continues from step 2, but .* holds later checkpoints of the same run"):
        preflight(tmp_path, resume=older)
    plan = preflight(tmp_path, resume=older, overwrite=True)
    assert plan.run == saver.run and [path.name for path in plan.removes] == ["step-00000003"]


def test_overwrite_never_removes_the_checkpoint_being_resumed(tmp_path: Path) -> None:
    saver = _checkpointer(tmp_path)
    saver.save(1)
    (tmp_path / RUN_FILE).unlink()  # which run owns the directory is no longer known
    with pytest.raises(ConfigError, match=rf"^--resume {tmp_path / 'step-00000001'}: {tmp_path} has no run.json"):
        preflight(tmp_path, resume=tmp_path / "step-00000001", overwrite=True)
    assert _steps(tmp_path) == [1]


def test_retention_keeps_the_newest_and_every_kth_step(tmp_path: Path) -> None:
    saver = _checkpointer(tmp_path, keep_last=2, keep_every=3)
    for step in range(1, 8):
        saver.save(step)
    assert _steps(tmp_path) == [3, 6, 7]


def test_a_step_directory_without_its_marker_is_refused_never_deleted(tmp_path: Path) -> None:
    stranger = tmp_path / "step-00000001"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("not a checkpoint\n")
    with pytest.raises(
        ConfigError,
        match=rf"^the checkpoint directory {tmp_path} holds step-00000001, which has no checkpoint.json: it was not "
        r"written by a checkpointer \(or is incomplete\) and is never deleted or replaced; move or delete it",
    ):
        preflight(tmp_path, overwrite=True)
    with pytest.raises(ConfigError, match=r"something not written by a checkpointer is in its place"):
        _checkpointer(tmp_path).save(1)
    assert (stranger / "notes.txt").read_text() == "not a checkpoint\n"


def test_a_partial_checkpoint_of_a_killed_writer_is_ignored_and_cleaned_at_the_next_save(tmp_path: Path) -> None:
    saver = _checkpointer(tmp_path)
    saver.save(1)
    partial = tmp_path / ".step-00000002.k1ll3d.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert find_checkpoint(tmp_path).step == 1
    saver.save(3)
    assert not partial.exists() and _steps(tmp_path) == [1, 3]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"step": "20"}, r"Expected `int`, got `str` - at `\$.step`"),
        ({"step": -1}, r"Expected `int` >= 0 - at `\$.step`"),
        ({"step": 10**13}, r"Expected `int` <= 1000000000000 - at `\$.step`"),
        ({"weights": 3}, r"Expected `str`, got `int` - at `\$.weights`"),
        ({"consumed_batches": None}, r"Expected `array`, got `null` - at `\$.consumed_batches`"),
        ({"run": None}, r"Expected `str`, got `null` - at `\$.run`"),
    ],
)
def test_a_malformed_checkpoint_json_is_refused_naming_the_checkpoint(
    tmp_path: Path, change: dict[str, object], problem: str
) -> None:
    path = _checkpointer(tmp_path).save(1)
    info = json.loads((path / MARKER).read_text())
    (path / MARKER).write_text(json.dumps({**info, **change}))
    with pytest.raises(ConfigError, match=rf"^the checkpoint {path} is not valid: checkpoint.json: {problem}"):
        _checkpointer(tmp_path).resume(path)


def test_a_checkpoint_of_another_format_is_refused_saying_so(tmp_path: Path) -> None:
    path = _checkpointer(tmp_path).save(1)
    (path / MARKER).write_text(json.dumps({"format": 1, "step": 1, "weights": "full", "consumed_batches": []}))
    with pytest.raises(
        ConfigError,
        match=rf"^the checkpoint {path} has format 1 \(another version of thundersync wrote it\); this version reads "
        r"format 2: resume it with the version that wrote it, or move it away$",
    ):
        _checkpointer(tmp_path).resume(tmp_path)


def test_a_checkpoint_json_missing_a_key_is_refused(tmp_path: Path) -> None:
    path = _checkpointer(tmp_path).save(1)
    info = json.loads((path / MARKER).read_text())
    del info["consumed_batches"]
    (path / MARKER).write_text(json.dumps(info))
    with pytest.raises(ConfigError, match=r"Object missing required field `consumed_batches`"):
        _checkpointer(tmp_path).resume(tmp_path)


@pytest.mark.usefixtures("alarm")
@pytest.mark.parametrize("name", [MARKER, STATE_FILE, "model.safetensors"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_without_blocking(tmp_path: Path, name: str) -> None:
    path = _checkpointer(tmp_path).save(1)
    (path / name).unlink()
    os.mkfifo(path / name)
    with pytest.raises(ConfigError, match=rf"^the checkpoint {path}.*{name}: it is a FIFO, not a regular file"):
        _checkpointer(tmp_path).resume(path)


def test_a_symlink_in_place_of_the_training_state_is_not_followed(tmp_path: Path) -> None:
    path = _checkpointer(tmp_path).save(1)
    elsewhere = tmp_path / "elsewhere.pt"
    (path / STATE_FILE).rename(elsewhere)
    (path / STATE_FILE).symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=rf"{path / STATE_FILE}: it is a symbolic link, not a regular file"):
        _checkpointer(tmp_path).resume(path)


def test_damaged_weights_and_state_are_one_error_naming_the_checkpoint_and_the_file(tmp_path: Path) -> None:
    path = _checkpointer(tmp_path).save(1)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    save_file({**tensors, "model.embed_tokens.weight": torch.zeros(2, 2)}, weights)
    with pytest.raises(
        ConfigError, match=rf"^the checkpoint {path}: its weights do not fit the model: .*size mismatch.*; resume with"
    ):
        _checkpointer(tmp_path).resume(path)
    weights.write_bytes(b"\x00" * 7)
    with pytest.raises(ConfigError, match=rf"^the checkpoint {path}: model.safetensors is not a readable safetensors"):
        _checkpointer(tmp_path).resume(path)
    save_file(tensors, weights)
    (path / STATE_FILE).write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match=rf"^the checkpoint {path}: {STATE_FILE} does not restore this run's"):
        _checkpointer(tmp_path).resume(path)
    torch.save({"optimizer": {}}, path / STATE_FILE)
    with pytest.raises(ConfigError, match=rf"^the checkpoint {path}: {STATE_FILE} does not restore .*\(KeyError"):
        _checkpointer(tmp_path).resume(path)


def test_a_teacher_path_names_the_newest_checkpoint_of_the_directorys_run(tmp_path: Path) -> None:
    saver = _checkpointer(tmp_path / "run", keep_last=5)
    saver.save(5)
    saver.save(10)
    stray = _checkpointer(tmp_path / "other")
    copied = stray.save(40)  # another run's checkpoint copied in: never the teacher
    copied.rename(tmp_path / "run" / copied.name)
    (tmp_path / "run" / ".step-00000050.x.tmp").mkdir()  # a partial one neither
    assert model_directory(tmp_path / "run") == tmp_path / "run" / "step-00000010"
    assert model_directory(tmp_path / "run" / "step-00000005") == tmp_path / "run" / "step-00000005"
    with pytest.raises(ConfigError, match=r"holds no checkpoint of full weights of its run"):
        model_directory(tmp_path / "empty")
