"""bench/agent_env.py runs end to end (local backend, a few episodes), so a change cannot break it unseen."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_agent_environment_bench_runs_and_prints_its_table() -> None:
    done = subprocess.run(
        [sys.executable, "bench/agent_env.py", "--tiny"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| backend | slots | episodes/s | episode s | generation % | tool calls % |" in done.stdout
    assert done.stdout.count("| local |") == 2
