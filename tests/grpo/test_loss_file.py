"""A pipeline file selects a loss form; its importance-weight statistics reach the step lines."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.app.test_train_file import _run


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
