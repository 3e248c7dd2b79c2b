"""A pipeline file turns on dynamic sampling (the ``failures`` object) and overlong handling (the
reward stage's options); the step lines count the groups dropped as uninformative and refilled."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from thundersync.app.cli.command import main
from thundersync.app.files import loads
from thundersync.errors import DefinitionError

FILE = """\
# thundersync run sampled.toml
[objects.generator]
factory = "test-scripted-generator"
[objects.scorer]
factory = "test-fake-scorer"
[objects.policy]
factory = "policy-clock"
[objects.failures]
factory = "episode-failures"
dynamic_sampling = true
max_oversample = 3
[stages.source]
type = "source"
prompts = [[1, 2], [3], [4, 5, 6]]
samples = 1
groups_per_batch = 2
[stages.generate]
type = "generate"
reads = ["source"]
max_new_tokens = 4
[stages.reward]
type = "reward"
reads = ["generate"]
overlong = "penalty"
max_tokens = 4
overlong_buffer = 2
[stages.close]
type = "close"
reads = ["generate", "reward"]
[stages.step]
type = "step"
reads = ["close"]
output = true
"""


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # main() configures logging for the process, as a CLI does


def _steps(tmp_path: Path, text: str) -> list[dict[str, Any]]:
    path, metrics = tmp_path / "sampled.toml", tmp_path / "m.jsonl"
    path.write_text(text)
    assert main(["run", str(path), "--metrics", str(metrics), "--no-progress"]) == 0
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "step"]


def test_a_file_drops_uninformative_groups_up_to_max_oversample_and_counts_them(tmp_path: Path) -> None:
    # one sample per group: every group's rewards are all equal. Batch 0 drops its two groups and
    # the first refill (max_oversample = 3), then keeps the next two refills.
    steps = _steps(tmp_path, FILE.replace("groups_per_batch = 2", "groups_per_batch = 2\nrepeat = 1"))
    first = steps[0]
    assert (first["groups_uninformative"], first["groups_refilled"], first["groups_dropped"]) == (3, 3, 0)
    assert all(step["overlong_filtered"] == 0 for step in steps)


def test_a_file_with_an_unknown_overlong_mode_fails_naming_the_field() -> None:
    with pytest.raises(DefinitionError, match=r"stages\.reward.*overlong"):
        loads(FILE.replace('overlong = "penalty"', 'overlong = "truncate"'))
