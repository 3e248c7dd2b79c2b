"""An ``admission`` object in a pipeline file bounds the groups in flight and reports it per step."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from thundersync.app.cli.command import main

FILE = """\
# thundersync run admitted.toml
[objects.generator]
factory = "test-scripted-generator"
delay_s = 0.002
[objects.scorer]
factory = "test-fake-scorer"
[objects.policy]
factory = "policy-clock"
[objects.admission]
factory = "admission"
max_groups = 2
[stages.source]
type = "source"
prompts = [[1, 2], [3], [4, 5, 6], [7], [8, 9], [10]]
samples = 2
groups_per_batch = 3
[stages.generate]
type = "generate"
reads = ["source"]
[stages.reward]
type = "reward"
reads = ["generate"]
[stages.close]
type = "close"
reads = ["generate", "reward"]
[stages.step]
type = "step"
reads = ["close"]
output = true
"""
KEYS = ("admission_waits", "admission_wait_s", "admission_forced", "in_flight_groups", "in_flight_tokens")


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # main() configures logging for the process, as a CLI does


def _steps(tmp_path: Path, text: str) -> list[dict[str, Any]]:
    path, metrics = tmp_path / "admitted.toml", tmp_path / "m.jsonl"
    path.write_text(text)
    assert main(["run", str(path), "--metrics", str(metrics), "--no-progress"]) == 0
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "step"]


def test_step_lines_carry_the_admission_decisions_within_the_bound(tmp_path: Path) -> None:
    steps = _steps(tmp_path, FILE)
    assert len(steps) == 2
    for record in steps:
        assert all(key in record for key in KEYS)
        assert 1 <= record["in_flight_groups"] <= 2
    assert sum(record["admission_waits"] for record in steps) >= 1
    assert all(record["admission_forced"] == 0 for record in steps)
    prompts_only = 2 * 3 * 2  # two groups of two samples of at most 3 prompt tokens
    assert max(record["in_flight_tokens"] for record in steps) > prompts_only, "generate counts its actions"


def test_step_lines_have_no_admission_keys_without_an_admission(tmp_path: Path) -> None:
    text = FILE.replace('[objects.admission]\nfactory = "admission"\nmax_groups = 2\n', "")
    steps = _steps(tmp_path, text)
    assert steps and not any(key in record for record in steps for key in KEYS)
