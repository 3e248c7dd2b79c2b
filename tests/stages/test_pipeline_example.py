"""examples/pipeline_grpo.py trains through a whole stage graph and reports each step."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline_grpo.py"


def test_the_pipeline_example_steps_once_per_batch_on_the_published_policy() -> None:
    out = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), "--steps", "3"],
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    )
    lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
    steps, summary = lines[:-1], lines[-1]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(0 <= s["mean_reward"] <= 1 and math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0 for s in steps)
    assert summary["steps"] == 3 and summary["first_mean_reward"] == steps[0]["mean_reward"]
