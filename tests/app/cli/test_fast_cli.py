"""``--help``, usage errors and ``check`` of a file without torch-backed objects never import torch
(it takes seconds to import): the command imports what a command needs when it runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROBE = """\
import runpy, sys
sys.argv = ["thundersync", *sys.argv[1:]]
try:
    runpy.run_module("thundersync", run_name="__main__")
except SystemExit as exit:
    status = exit.code
heavy = sorted(name for name in ("torch", "transformers", "triton") if name in sys.modules)
print("exit", status, "imported", heavy, file=sys.stderr)
"""


def _imports(*argv: str, cwd: Path = ROOT) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["--help"], 0),
        (["run", "--help"], 0),
        (["run"], 2),  # a usage error: no FILE
        (["check", "examples/pipeline_fake.toml"], 0),
        (["check", "examples/no-such-file.toml"], 2),
    ],
)
def test_the_command_answers_without_importing_torch(argv: list[str], status: int) -> None:
    assert _imports(*argv) == f"exit {status} imported []"


def test_check_of_a_broken_file_answers_without_importing_torch(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text('[stages.a]\ntype = "sourcee"\n')
    assert _imports("check", str(tmp_path / "bad.toml"), cwd=tmp_path) == "exit 2 imported []"
