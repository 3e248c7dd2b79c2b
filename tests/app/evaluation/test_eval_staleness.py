"""``[eval]`` under ``max_staleness = k >= 1`` (decision 082): an evaluation after step s runs on
exactly the weights of step s, while batches that started early may still be generating on them
(the step stage holds the next step, so the shared weights do not move during it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.app.evaluation.test_eval import _file, _lines, _restore_logging, _run
from thundersync.app.cli.command import main

__all__ = ["_restore_logging"]  # main() configures logging for the process: reset after each test


@pytest.mark.slow  # two CLI runs, as test_eval's
def test_an_evaluation_mid_run_under_k1_uses_exactly_the_weights_of_its_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = _file(tmp_path, 'tasks = "heldout"\nevery = 1\nsamples = 2\ntemperature = 0.0')  # greedy
    sets = ["objects.policy.max_staleness=1", 'objects.model.dtype="float64"', "objects.checkpointer.every=1"]
    sets += ["objects.checkpointer.keep_last=4", "stages.source.repeat=2"]  # 4 batches, 3 stepped
    assert _run(file, tmp_path / "run.jsonl", *(a for s in sets for a in ("--set", s))) == 0
    steps = _lines(tmp_path / "run.jsonl", "step")
    assert max(s["version_lag_max"] for s in steps) == 1  # later batches started before the step before them
    evals = {e["step"]: e for e in _lines(tmp_path / "run.jsonl", "eval")}
    mid = evals[2]
    assert evals[1]["eval_reward_mean"] != mid["eval_reward_mean"] != evals[3]["eval_reward_mean"]  # tells them apart
    checkpoint = tmp_path / "run" / "step-00000002"
    assert json.loads((checkpoint / "checkpoint.json").read_text())["consumed_batches"] == [0, 1]
    argv = ["eval", str(file), "--checkpoint", str(checkpoint), "--metrics", str(tmp_path / "eval.jsonl")]
    assert main([*argv, "--set", 'objects.model.dtype="float64"']) == 0
    (alone,) = _lines(tmp_path / "eval.jsonl", "eval")
    assert {k: v for k, v in alone.items() if k not in ("t", "eval_s")} == {
        k: v for k, v in mid.items() if k not in ("t", "eval_s")
    }
    capsys.readouterr()
