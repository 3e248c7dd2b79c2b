"""``thundersync run`` and its checkpoint directory: a rerun with --overwrite replaces the earlier
run, --resume continues it, and a plain rerun is refused before anything is built.

Runs examples/train_tiny_grpo.toml (two steps per source repeat), checkpointing every step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from thundersync.app.cli.command import main

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "train_tiny_grpo.toml"


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # main() configures logging for the process, as a CLI does


def _run(tmp_path: Path, repeat: int, metrics: str, *extra: str) -> int:
    argv = ["run", str(TINY), "--no-progress", "--metrics", str(tmp_path / metrics)]
    argv += ["--set", f'objects.checkpointer.directory="{tmp_path / "ckpt"}"', "--set", "objects.checkpointer.every=1"]
    return main([*argv, "--set", f"stages.source.repeat={repeat}", *extra])


def _checkpoints(tmp_path: Path) -> dict[str, str]:
    """step-N name -> the run its checkpoint.json names."""
    return {
        path.name: json.loads((path / "checkpoint.json").read_text())["run"]
        for path in sorted((tmp_path / "ckpt").glob("step-*"))
    }


def _steps(path: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "step"]


def test_an_overwrite_rerun_keeps_its_own_checkpoints_and_resume_continues_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(tmp_path, 2, "old.jsonl") == 0  # 4 steps: keeps 3 and 4
    old = set(_checkpoints(tmp_path).values())
    assert list(_checkpoints(tmp_path)) == ["step-00000003", "step-00000004"]
    capsys.readouterr()
    assert _run(tmp_path, 1, "new.jsonl", "--overwrite") == 0  # 2 steps: 1 and 2, higher ones of the old run gone
    err = capsys.readouterr().err
    assert (
        f"thundersync: --overwrite: removing from the checkpoint directory {tmp_path / 'ckpt'}: "
        "step-00000003, step-00000004, run.json\n"
    ) in err
    rerun = _checkpoints(tmp_path)
    assert list(rerun) == ["step-00000001", "step-00000002"] and not set(rerun.values()) & old
    assert _run(tmp_path, 2, "resumed.jsonl", "--resume", str(tmp_path / "ckpt")) == 0
    assert _steps(tmp_path / "resumed.jsonl") == [3, 4]  # from the rerun's step 2, not the old run's 4
    assert _checkpoints(tmp_path) == {"step-00000003": rerun["step-00000002"], "step-00000004": rerun["step-00000002"]}


def test_a_plain_rerun_into_a_directory_with_checkpoints_is_refused_before_building(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(tmp_path, 1, "a.jsonl") == 0
    before = _checkpoints(tmp_path)
    capsys.readouterr()
    assert _run(tmp_path, 1, "b.jsonl") == 2
    assert capsys.readouterr().err == (
        f"thundersync: invalid settings (ConfigError): the checkpoint directory {tmp_path / 'ckpt'} holds "
        "checkpoints of another run (steps 1, 2), which this run would mix with its own; continue that run with "
        f"--resume {tmp_path / 'ckpt'}, replace them with --overwrite, or give the checkpointer another directory\n"
    )
    assert not (tmp_path / "b.jsonl").exists() and _checkpoints(tmp_path) == before


def test_the_outputs_are_checked_before_anything_is_built(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other, metrics = tmp_path / "other.jsonl", tmp_path / "m.jsonl"
    other.write_text("another run's lines\n")
    os.link(other, metrics)
    broken = ["--set", "objects.model.config.hidden_size=-1"]  # building the model would fail
    assert _run(tmp_path, 1, "m.jsonl", "--overwrite", *broken) == 2
    assert capsys.readouterr().err == (
        f"thundersync: invalid settings (ConfigError): the metrics file {metrics} has 2 hard links, and --overwrite "
        "would empty it under every other name too; give --metrics (or run.metrics) the path of a new file, or "
        "remove this name first\n"
    )
    assert other.read_text() == "another run's lines\n"
