"""examples/streaming_grpo.py (the README's main job) runs, checks itself and steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "streaming_grpo.py"


def test_the_grpo_example_agrees_with_its_dense_reference_and_takes_a_step() -> None:
    out = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE)], capture_output=True, text=True, check=True, timeout=240
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    result = json.loads(lines[0])
    assert result["relative_error_vs_dense"] < result["tolerance"] == 1e-5 and result["within_tolerance"] is True
    assert result["step_moved_parameters_by"] > 0 and result["trajectories"] == 8
