"""``max_staleness`` in a pipeline file (the policy clock's option): 0 is today's path to the bit,
1 runs, reports its version lag, and resumes from a checkpoint taken while the next batch was in
flight without skipping or repeating a batch; the build refuses what would break it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.app.test_deterministic_file import TINY, _bitwise_equal, _run, _state
from thundersync.app.cli.command import main
from thundersync.app.files.build import build_graph
from thundersync.app.files.definition import load
from thundersync.errors import DefinitionError


def test_max_staleness_0_ends_bitwise_equal_to_a_file_without_the_option(tmp_path: Path) -> None:
    absent = _run(tmp_path / "absent", "float64")
    zero = _run(tmp_path / "zero", "float64", "objects.policy.max_staleness=0")
    assert absent == zero  # every metric but the clock's, the version lag (0) included
    assert [r["version_lag_max"] for r in zero] == [0, 0]
    assert _bitwise_equal(_state(tmp_path / "absent", 2), _state(tmp_path / "zero", 2))


def _steps(directory: Path, *sets: str, resume: Path | None = None, metrics: str = "m.jsonl") -> list[dict[str, Any]]:
    directory.mkdir(parents=True, exist_ok=True)
    argv = ["run", str(TINY), "--metrics", str(directory / metrics), "--no-progress"]
    for item in (
        f'objects.checkpointer.directory="{directory / "ckpt"}"',
        "objects.checkpointer.every=1",
        "objects.checkpointer.keep_last=4",
        "objects.policy.max_staleness=1",
        "stages.source.repeat=2",  # 4 prompts x 2 / 2 groups per batch: 4 batches
        *sets,
    ):
        argv += ["--set", item]
    if resume is not None:
        argv += ["--resume", str(resume)]
    assert main(argv) == 0
    lines = [json.loads(line) for line in (directory / metrics).read_text().splitlines()]
    return [line for line in lines if line["event"] == "step"]


def test_a_k1_run_resumed_from_a_mid_run_checkpoint_regenerates_the_batches_in_flight(tmp_path: Path) -> None:
    whole = _steps(tmp_path / "whole")
    assert [(r["step"], r["batch_id"]) for r in whole] == [(1, 0), (2, 1), (3, 2), (4, 3)]
    assert all(0 <= r["version_lag_mean"] <= r["version_lag_max"] <= 1 for r in whole)
    assert max(r["version_lag_max"] for r in whole) == 1  # later batches started before the step before them
    checkpoint = tmp_path / "whole" / "ckpt" / "step-00000002"  # taken while batch 2 was being generated
    assert json.loads((checkpoint / "checkpoint.json").read_text())["consumed_batches"] == [0, 1]
    resumed = _steps(tmp_path / "resumed", resume=checkpoint)
    assert [(r["step"], r["batch_id"]) for r in resumed] == [(3, 2), (4, 3)]  # nothing skipped, nothing repeated
    assert resumed[0]["version_lag_max"] == 0  # batch 2 was generated again, on the restored version 2


def test_the_build_refuses_what_bounded_staleness_cannot_run_with() -> None:
    k1 = ["objects.policy.max_staleness=1"]
    build_graph(load(TINY, k1))
    with pytest.raises(DefinitionError, match=r"stages.close.wait_for: the policy clock has max_staleness = 1"):
        build_graph(load(TINY, [*k1, 'stages.close.wait_for=["reward"]', 'stages.close.reads=["generate", "reward"]']))
    with pytest.raises(
        DefinitionError, match=r"stages.backward.objects.policy: the policy clock has max_staleness = 1"
    ):
        build_graph(
            load(TINY, [*k1, 'objects.other={factory="policy-clock"}', 'stages.backward.objects={policy="other"}'])
        )
    with pytest.raises(DefinitionError, match=r"run.deterministic: the policy clock has max_staleness = 1"):
        build_graph(load(TINY, [*k1, "run.deterministic=true"]))
    with pytest.raises(DefinitionError, match=r"objects.policy: policy-clock failed: max_staleness must be an integer"):
        build_graph(load(TINY, ["objects.policy.max_staleness=-1"]))


def test_run_max_staleness_reaches_every_clock_whose_table_gives_none() -> None:
    graph = build_graph(load(TINY, ["run.max_staleness=2"]))
    assert graph["generate"].stage.policy.max_staleness == 2  # type: ignore[attr-defined]
    assert graph["backward"].stage.policy is graph["generate"].stage.policy  # type: ignore[attr-defined]
    own = build_graph(load(TINY, ["run.max_staleness=2", "objects.policy.max_staleness=1"]))
    assert own["generate"].stage.policy.max_staleness == 1  # type: ignore[attr-defined]
    assert build_graph(load(TINY))["generate"].stage.policy.max_staleness == 0  # type: ignore[attr-defined]
    with pytest.raises(DefinitionError, match=r"run.max_staleness"):
        load(TINY, ["run.max_staleness=-1"])
