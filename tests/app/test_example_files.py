"""Every pipeline file in examples/ runs two optimizer steps through the real CLI and writes the
metrics keys the issue lists.

Each file runs as ``python -m thundersync run FILE --set run.steps=2`` in a scratch working
directory (``examples/`` linked into it, so relative data paths resolve while metrics and
checkpoints stay out of the repository). A file whose short run needs more overrides declares
them in a leading comment line (before its first table)::

    # ci-overrides: objects.warmup.steps=2 objects.model.config.num_hidden_layers=1

(``KEY=VALUE`` items split like a shell line, so quote a value with spaces; they come after
``run.steps=2`` and win over it). A file that needs another file's output (a checkpoint to distil
from) names it in a ``# ci-after: examples/OTHER.toml`` line: the other file's short run goes
first, in the same working directory. A file whose sandboxes are ``docker`` or ``udocker`` (after
those overrides) is a ``docker`` test: it skips without that engine, or fails under
``THUNDERSYNC_REQUIRE_SANDBOXES=1``, as the sandbox tests do.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.app.metrics.test_step_metrics import KEYS
from tests.sandboxes.conftest import require
from thundersync.app.files.definition import load

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = ("docker", "udocker")
pytestmark = pytest.mark.slow


def ci_items(path: Path, key: str) -> list[str]:
    """The items of the file's leading ``# KEY:`` comment lines (``ci-overrides``, ``ci-after``)."""
    items: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            break
        body = line.lstrip().lstrip("#").strip()
        if body.startswith(f"{key}:"):
            items += shlex.split(body.removeprefix(f"{key}:"))
    return items


def ci_overrides(path: Path) -> list[str]:
    """The ``# ci-overrides:`` items of the file's leading comment lines."""
    return ci_items(path, "ci-overrides")


def container_backends(path: Path) -> list[str]:
    """The container engines the file's objects start sandboxes with (after its ci-overrides)."""
    spec = load(path, ["run.steps=2", *ci_overrides(path)])
    return sorted({obj.args["backend"] for obj in spec.objects.values() if obj.args.get("backend") in CONTAINERS})


def chain(path: Path) -> list[Path]:
    """The files a case of ``path`` runs, in order: its ``ci-after`` files, then itself."""
    return [ROOT / before for before in ci_items(path, "ci-after")] + [path]


def _cases() -> list[Any]:
    """One case per file, except a file another one runs first (its ``ci-after``): that file's
    case checks both runs, so its short run happens once."""
    files = sorted((ROOT / "examples").glob("*.toml"))
    first = {(ROOT / before).resolve() for path in files for before in ci_items(path, "ci-after")}
    cases = []
    for path in files:
        if path.resolve() in first:
            continue
        marks = [pytest.mark.docker] if any(container_backends(p) for p in chain(path)) else []
        cases.append(pytest.param(path, marks=marks, id=path.name))
    return cases


@pytest.mark.parametrize("path", _cases())
def test_the_example_file_runs_two_steps_and_writes_every_metrics_key(path: Path, tmp_path: Path) -> None:
    files = chain(path)
    for backend in sorted({b for p in files for b in container_backends(p)}):
        require(backend)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for file in files:
        steps = run_two_steps(file, tmp_path, tmp_path / f"{file.stem}.metrics.jsonl")
        assert [r["step"] for r in steps] == [1, 2], file.name
        for record in steps:
            assert not KEYS - record.keys(), f"{file.name}, step {record['step']} lacks {sorted(KEYS - record.keys())}"


def test_every_example_file_is_run_by_a_case() -> None:
    ran = {file.name for case in _cases() for file in chain(case.values[0])}
    assert ran == {path.name for path in (ROOT / "examples").glob("*.toml")}


def run_two_steps(path: Path, cwd: Path, metrics: Path) -> list[dict[str, Any]]:
    """Run ``path`` for two steps with its ci-overrides in ``cwd``; its step records."""
    command = [sys.executable, "-m", "thundersync", "run", str(path), "--metrics", str(metrics), "--no-progress"]
    for item in ["run.steps=2", *ci_overrides(path)]:
        command += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{shlex.join(command)}\n{run.stderr[-4000:]}"
    return [r for line in metrics.read_text().splitlines() if (r := json.loads(line))["event"] == "step"]


def test_ci_overrides_are_read_from_the_leading_comment_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text(
        "# thundersync run x.toml\n#\n# ci-overrides: a.b=1 c.d='\"two words\"'\n[run]\n# ci-overrides: e.f=3\n"
    )
    assert ci_overrides(path) == ["a.b=1", 'c.d="two words"']
    path.write_text("# ci-after: examples/a.toml\n# ci-overrides: x=1\n[run]\n")
    assert ci_items(path, "ci-after") == ["examples/a.toml"]
