"""A pipeline file selects a loss form; its importance-weight statistics reach the step lines."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.app.test_train_file import TINY, _run
from thundersync.app.cli.command import main


@pytest.mark.parametrize("loss", ["tis", "gspo"])
def test_a_file_trains_with_a_loss_form_and_its_steps_report_the_importance_weights(tmp_path: Path, loss: str) -> None:
    records = _run(tmp_path, f'objects.objective.loss="{loss}"', "objects.trainer.audit_every=1")
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    for step in steps:
        assert step["is_count"] > 0 and 0 <= step["is_clip_fraction"] <= 1
        assert math.isfinite(step["is_mean"]) and step["is_max"] >= step["is_mean"] > 0
        assert step["audit_rel_error"] < 1e-5  # the audit's dense gradient uses the same form


def test_a_grpo_file_has_no_importance_weight_keys(tmp_path: Path) -> None:
    steps = [r for r in _run(tmp_path) if r["event"] == "step"]
    assert steps and not any(key.startswith("is_") for step in steps for key in step)


def test_a_lora_file_trains_with_kl_to_its_base_model_and_reports_it(tmp_path: Path) -> None:
    lora = 'objects.model.lora={ r = 4, lora_alpha = 8, target_modules = ["q_proj", "v_proj"], lora_dropout = 0.0 }'
    steps = [
        r
        for r in _run(tmp_path, lora, "objects.objective.kl_coef=0.1", "objects.trainer.audit_every=1")
        if r["event"] == "step"
    ]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["kl"]) and r["audit_rel_error"] < 1e-5 for r in steps)
    assert steps[1]["kl"] != 0.0  # step 1 moved the adapter away from the base model


def test_kl_in_a_file_without_lora_is_refused_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", str(TINY), "--metrics", str(tmp_path / "m.jsonl"), "--no-progress"]
    assert main([*argv, "--set", "objects.objective.kl_coef=0.1"]) == 2
    err = capsys.readouterr().err
    assert "kl_coef > 0 needs a reference model" in err and "lora = {...} in the model's table" in err


def test_a_learner_process_trains_with_a_loss_form_without_reporting_its_statistics(tmp_path: Path) -> None:
    sets = ('objects.objective.loss="gspo"', "objects.objective.process=true", "objects.trainer.audit_every=1")
    steps = [r for r in _run(tmp_path, *sets) if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["audit_rel_error"] < 1e-5 and "is_mean" not in r for r in steps)
