"""examples/streaming_opd.py runs and agrees with its dense reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "streaming_opd.py"


def test_the_opd_example_prints_one_json_line_matching_the_dense_reference() -> None:
    out = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), "--device", "cpu"],
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    result = json.loads(lines[0])
    assert result["relative_error"] < 1e-5 and result["within_tolerance"] is True
    assert result["grad_norm"] > 0 and result["step_moved_parameters_by"] > 0
    assert result["trajectories"] == 6
