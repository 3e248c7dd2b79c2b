"""`[run] tensorboard = "DIR"`: each step line's numbers as TensorBoard scalars, next to the metrics file."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from thundersync.app.cli.command import main
from thundersync.app.metrics.jsonl import JsonlMetrics
from thundersync.app.metrics.tensorboard import TensorBoardSteps

ROOT = Path(__file__).resolve().parents[3]
FAKE = ROOT / "examples" / "pipeline_fake.toml"
TINY = ROOT / "examples" / "train_tiny_grpo.toml"


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # main() configures logging for the process, as a CLI does


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _run_fake(tmp_path: Path, *extra: str) -> int:
    argv = ["run", str(FAKE), "--no-progress", "--metrics", str(tmp_path / "m.jsonl"), "--set", "run.steps=3"]
    return main([*argv, "--set", f'run.tensorboard="{tmp_path / "tb"}"', *extra])


def test_every_numeric_key_of_each_step_line_is_a_scalar_at_its_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run_fake(tmp_path) == 0
    assert f"; tensorboard: {tmp_path / 'tb'}" in capsys.readouterr().err  # the summary line says where
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line["event"] == "step"]
    scalars = _scalars(tmp_path / "tb")
    numeric = {k for s in steps for k, v in s.items() if isinstance(v, (int, float)) and k not in ("t", "step")}
    assert {"reward_mean", "step_s", "tokens", "grad_norm"} <= numeric
    assert set(scalars) == numeric  # null keys (audit_rel_error...) are left out
    for key in numeric:
        assert scalars[key] == [(s["step"], pytest.approx(s[key])) for s in steps if key in s]
    assert [step for step, _ in scalars["reward_mean"]] == [1, 2, 3]


def test_a_directory_with_an_earlier_runs_events_needs_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run_fake(tmp_path) == 0
    assert _run_fake(tmp_path, "--overwrite") == 0  # the metrics file and the old event file are replaced
    assert len(list((tmp_path / "tb").iterdir())) == 1
    assert [step for step, _ in _scalars(tmp_path / "tb")["tokens"]] == [1, 2, 3]
    (tmp_path / "m.jsonl").unlink()
    capsys.readouterr()
    assert _run_fake(tmp_path) == 2
    assert "already holds 1 event file(s) of an earlier run" in capsys.readouterr().err


def test_overwrite_removes_only_regular_event_files(tmp_path: Path) -> None:
    board, outside = tmp_path / "tb", tmp_path / "outside"
    board.mkdir()
    outside.write_text("not an event file of this run\n")
    (board / "events.out.tfevents.1.old").write_bytes(b"an earlier run's events")
    (board / "events.out.tfevents.2.dir").mkdir()
    (board / "events.out.tfevents.3.link").symlink_to(outside)
    (board / "notes.txt").write_text("kept\n")
    assert _run_fake(tmp_path, "--overwrite") == 0
    left = sorted(path.name for path in board.iterdir())
    assert "events.out.tfevents.1.old" not in left
    assert {"events.out.tfevents.2.dir", "events.out.tfevents.3.link", "notes.txt"} <= set(left)
    assert outside.read_text() == "not an event file of this run\n"


def test_resume_adds_to_the_directory_from_the_checkpoints_step(tmp_path: Path) -> None:
    argv = ["run", str(TINY), "--no-progress", "--set", f'objects.checkpointer.directory="{tmp_path / "ckpt"}"']
    argv += ["--set", "stages.source.repeat=1", "--set", f'run.tensorboard="{tmp_path / "tb"}"']
    assert main([*argv, "--metrics", str(tmp_path / "a.jsonl")]) == 0
    resumed = ["--metrics", str(tmp_path / "b.jsonl"), "--resume", str(tmp_path / "ckpt")]
    assert main([*argv, "--set", "stages.source.repeat=2", *resumed]) == 0
    assert len(list((tmp_path / "tb").iterdir())) == 2
    assert [step for step, _ in _scalars(tmp_path / "tb")["grad_norm"]] == [1, 2, 3, 4]


def test_the_writer_is_closed_when_the_run_fails(tmp_path: Path) -> None:
    tensorboard = TensorBoardSteps(tmp_path / "tb")
    with pytest.raises(RuntimeError), JsonlMetrics(None, tensorboard=tensorboard) as sink:
        sink.write("step", step=1, reward_mean=0.5, groups_per_rank=[1, 2], lr=None)
        raise RuntimeError("a stage failed")
    assert tensorboard._writer is None
    assert _scalars(tmp_path / "tb") == {"reward_mean": [(1, 0.5)]}


def test_check_and_run_say_how_to_install_a_missing_tensorboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now raises ImportError
    tensorboard = ["--set", f'run.tensorboard="{tmp_path / "tb"}"']
    assert main(["check", str(FAKE), *tensorboard]) == 1
    assert main(["run", str(FAKE), "--no-progress", *tensorboard]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("pip install tensorboard" in line for line in err)
    assert "run.tensorboard needs the 'train' extra (module 'tensorboard' is not installed)" in err[0]
    assert not (tmp_path / "tb").exists()
    assert main(["check", str(FAKE)]) == 0  # without run.tensorboard, nothing needs it


def test_a_resumed_writer_hides_what_the_earlier_run_wrote_after_the_checkpoint(tmp_path: Path) -> None:
    with JsonlMetrics(None, tensorboard=TensorBoardSteps(tmp_path / "tb")) as crashed:
        for step in (1, 2, 3):  # the checkpoint was at step 1; steps 2 and 3 are lost with the run
            crashed.write("step", step=step, lr=0.0)
    with JsonlMetrics(None, tensorboard=TensorBoardSteps(tmp_path / "tb", resume_step=1)) as resumed:
        for step in (2, 3):
            resumed.write("step", step=step, lr=1.0)
    assert _scalars(tmp_path / "tb") == {"lr": [(1, 0.0), (2, 1.0), (3, 1.0)]}
