"""The JSONL metrics sink writes one flushed object per line, and nothing without a path."""

from __future__ import annotations

import json
from pathlib import Path

from thundersync.app.metrics import JsonlMetrics
from thundersync.events import GroupClosed
from thundersync.pipeline._stats import RunStatistics, StageStatistics


def test_lines_are_written_and_flushed_as_they_come(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "m.jsonl"
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
    assert [r["type"] for r in records] == ["run_started", "GroupClosed", "stage_statistics"]
    assert records[1] | {"t": 0} == {"t": 0, "type": "GroupClosed", "group_id": "g", "num_trajectories": 4}
    assert records[2]["name"] == "s" and records[2]["received"] == 3
    assert all(r["t"] >= 0 for r in records) and metrics.lines == 3


def test_a_sink_without_a_path_writes_nothing(tmp_path: Path) -> None:
    with JsonlMetrics(None) as metrics:
        metrics.write("run_started")
    assert metrics.lines == 0 and list(tmp_path.iterdir()) == []
