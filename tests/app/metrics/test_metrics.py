"""The JSONL metrics sink writes one object per line as it comes, to a new regular file only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from thundersync.app.metrics.jsonl import JsonlMetrics
from thundersync.errors import ConfigError
from thundersync.events import GroupClosed
from thundersync.pipeline._stats import RunStatistics, StageStatistics


def test_lines_are_written_and_flushed_as_they_come(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    stats = RunStatistics(
        stages={
            "s": StageStatistics(
                name="s",
                state="done",
                received=3,
                sent=2,
                unrouted=0,
                input_wait_s=0.0,
                output_wait_s=0.0,
                elapsed_s=1.0,
            )
        },
        inboxes={},
        edges=[],
        elapsed_s=1.0,
    )
    with JsonlMetrics(path) as metrics:
        metrics.write("run_started", file="x.toml")
        metrics.event(GroupClosed(group_id="g", num_trajectories=4))
        assert len(path.read_text().splitlines()) == 2  # readable before the sink closes
        metrics.statistics(stats)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["run_started", "GroupClosed", "stage_statistics"]
    want = {"t": 0, "event": "GroupClosed", "group_id": "g", "num_trajectories": 4, "dropped": False}
    want |= {"uninformative": False}
    assert records[1] | {"t": 0} == want
    assert records[2]["name"] == "s" and records[2]["received"] == 3
    assert all(r["t"] >= 0 for r in records) and metrics.lines == 3


def test_a_sink_without_a_path_writes_nothing(tmp_path: Path) -> None:
    with JsonlMetrics(None) as metrics:
        metrics.write("run_started")
    assert metrics.lines == 0 and list(tmp_path.iterdir()) == []


def test_the_directory_must_exist_and_is_never_created(tmp_path: Path) -> None:
    missing = tmp_path / "new dir"
    with (
        pytest.raises(
            ConfigError,
            match=rf"^the metrics file {missing / 'm.jsonl'} cannot be created: its directory {missing} does not "
            rf"exist; create it first \(mkdir -p '{missing}'\)$",
        ),
        JsonlMetrics(missing / "m.jsonl"),
    ):
        pass
    assert not missing.exists()


def test_an_existing_file_is_replaced_only_with_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("an earlier run, longer than the new one\n")
    with (
        pytest.raises(ConfigError, match=r"already exists and is never overwritten silently; choose a new path, or"),
        JsonlMetrics(path),
    ):
        pass
    assert path.read_text() == "an earlier run, longer than the new one\n"
    with JsonlMetrics(path, overwrite=True) as metrics:
        metrics.write("run_started")
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["run_started"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_symlink_is_never_written_through(tmp_path: Path, overwrite: bool) -> None:
    target, link = tmp_path / "target", tmp_path / "m.jsonl"
    target.write_text("not yours\n")
    link.symlink_to(target)
    with (
        pytest.raises(ConfigError, match=rf"^the metrics path {link} is a symbolic link, not a regular file; give"),
        JsonlMetrics(link, overwrite=overwrite),
    ):
        pass
    assert target.read_text() == "not yours\n"


def test_overwrite_never_truncates_a_file_with_other_hard_links(tmp_path: Path) -> None:
    other, path = tmp_path / "results.jsonl", tmp_path / "m.jsonl"
    other.write_text("another run's lines\n")
    os.link(other, path)
    with (
        pytest.raises(
            ConfigError,
            match=rf"^the metrics file {path} has 2 hard links, and --overwrite would empty it under every other "
            r"name too; give --metrics \(or run.metrics\) the path of a new file, or remove this name first$",
        ),
        JsonlMetrics(path, overwrite=True),
    ):
        pass
    assert other.read_text() == "another run's lines\n"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_fifo_or_a_directory_is_refused_without_blocking(tmp_path: Path, overwrite: bool) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "FIFO"), (tmp_path, "directory")):
        with (
            pytest.raises(ConfigError, match=rf"^the metrics path {path} is a {kind}, not a regular file"),
            JsonlMetrics(path, overwrite=overwrite),
        ):
            pass
