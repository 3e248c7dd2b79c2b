"""The README's quick start ("Run the main job"), as written, in a fast variant.

The commands are parsed out of README.md's first ``bash`` block after that heading, so they cannot
drift: the ``pip install`` commands are checked (the CPU index, the extras the later commands
need), and each ``thundersync`` command runs as ``python -m thundersync ...`` in a scratch working
directory holding a copy of ``examples/``, the run with a 2-step warm-up and 1 GRPO step
(``--set`` overrides). It must exit 0 and write what the README says: the metrics file with its
lines, the checkpoints, the plot; and stderr must show the phases' lines and times.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--set", "run.steps=1", "--set", "objects.model.steps=2", "--set", "stages.source.groups_per_batch=2"]
pytestmark = pytest.mark.slow


def quick_start() -> list[list[str]]:
    """The commands of the quick start's one-line block, split at ``&&``."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Run the main job\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)\n```", section, re.S)
    assert block is not None, "the quick start has no bash block"
    return [shlex.split(command) for command in block.group(1).replace("\\\n", " ").split("&&")]


def _section_text() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return " ".join(readme.split("\n## Run the main job\n", 1)[1].split("\n## ", 1)[0].split())


def test_the_quick_start_installs_torchs_cpu_build_and_the_extras_its_commands_need() -> None:
    commands = quick_start()
    torch = [c for c in commands if c[:2] == ["pip", "install"] and any(a.startswith("torch") for a in c)]
    assert torch and "https://download.pytorch.org/whl/cpu" in torch[0], torch
    package = [c for c in commands if c[:3] == ["pip", "install", "-e"]]
    assert package, commands
    extras = set(re.fullmatch(r"\.\[(.*)\]", package[0][3]).group(1).split(","))  # type: ignore[union-attr]
    if any(c[:2] == ["thundersync", "plot"] for c in commands):
        assert "plot" in extras, extras


def test_the_quick_start_commands_run_and_write_what_the_readme_says(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    ran = []
    for command in quick_start():
        if command[0] != "thundersync":
            continue
        argv = [sys.executable, "-m", "thundersync", *command[1:]]
        if command[1] == "run":
            argv += FAST
        done = subprocess.run(argv, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        ran.append((command[1], done.stderr))
    assert [name for name, _ in ran] == ["run", "plot"]
    _check_outputs(tmp_path, ran[0][1])


def _check_outputs(directory: Path, stderr: str) -> None:
    text = _section_text()
    assert "writes `agent_grpo.jsonl` and checkpoints to `runs/agent_grpo`" in text
    records = [json.loads(line) for line in (directory / "agent_grpo.jsonl").read_text().splitlines()]
    kinds = Counter(record["event"] for record in records)
    assert kinds == Counter(
        {"run_started": 1, "step": 1, "StepDone": 1, "PolicyPublished": 1, "stage_statistics": 8, "run_finished": 1}
    )
    # what the README says the file holds, and its count for the file's 32 steps
    said = re.search(r"(\d+) lines for the file's (\d+) steps", text)
    assert said is not None and int(said.group(1)) == 3 * int(said.group(2)) + 8 + 2
    assert all(word in text for word in ("`step` line", "`StepDone`", "`PolicyPublished`", "`stage_statistics`"))
    assert (directory / "runs" / "agent_grpo" / "step-00000001").is_dir()
    assert "`agent_grpo.png`" in text and (directory / "agent_grpo.png").stat().st_size > 0
    # not a terminal: no live line; the warm-up leaves its line, the summary gives each phase's time
    assert "\r" not in stderr
    assert re.search(r"^thundersync: warm-up 2/2 steps in 0:\d\d:\d\d  [\d.]+ steps/s  loss \d+\.\d{3}$", stderr, re.M)
    assert re.search(
        r"^thundersync: 1/1 steps in \S+ \(build \S+ \(warm-up \S+\), steps \S+; total \S+\), last reward", stderr, re.M
    ), stderr
    assert "warnings.warn(" not in stderr and "Traceback" not in stderr
