"""The Triton kernels on CPU under ``TRITON_INTERPRET=1``, in a fresh interpreter (see interpreted_cases.py)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

CASES = pathlib.Path(__file__).with_name("interpreted_cases.py")


def test_triton_kernels_match_the_references_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, cwd=CASES.parents[2])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\b32 passed\b", done.stdout), done.stdout[-2000:]
