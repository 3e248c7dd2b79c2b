"""``[run] steps = N``: a file runs N optimizer steps, its source repeating tasks as needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thundersync.app.cli.command import main
from thundersync.app.files.build import build_graph
from thundersync.app.files.check import check_pipeline
from thundersync.app.files.definition import loads
from thundersync.errors import DefinitionError
from thundersync.stages.source import SourceStage

ROOT = Path(__file__).resolve().parents[3]
FAKE = ROOT / "examples" / "pipeline_fake.toml"
TINY = ROOT / "examples" / "train_tiny_grpo.toml"
TWO_SOURCES = """\
[run]
steps = 3
[stages.a]
type = "source"
prompts = [[1]]
[stages.b]
type = "source"
prompts = [[2]]
"""


def _steps(path: Path) -> list[dict[str, object]]:
    return [r for line in path.read_text().splitlines() if (r := json.loads(line))["event"] == "step"]


def test_run_steps_overrides_the_sources_epochs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "m.jsonl"
    # 4 prompts, 2 groups per batch, repeat = 1 would be 2 steps; repeat = 25 would be 50
    for repeat, steps in ((1, 7), (25, 3)):
        argv = ["run", str(FAKE), "--metrics", str(metrics), "--overwrite", "--set", f"run.steps={steps}"]
        assert main([*argv, "--set", f"stages.source.repeat={repeat}"]) == 0
        assert [r["step"] for r in _steps(metrics)] == list(range(1, steps + 1))
        assert capsys.readouterr().err.startswith(f"thundersync: {steps}/{steps} steps in ")  # the progress total


def test_without_run_steps_the_source_decides() -> None:
    spec = loads(FAKE.read_text())
    assert spec.run.steps is None
    source = build_graph(spec)["source"].stage
    assert isinstance(source, SourceStage) and (source.batch_limit, source.num_batches) == (None, 50)


def test_run_steps_needs_exactly_one_source_stage_and_check_says_so() -> None:
    spec = loads(TWO_SOURCES)
    for validate in (check_pipeline, build_graph):
        with pytest.raises(
            DefinitionError, match=r"run.steps: 3 steps need exactly one source stage .* has 2 \(a, b\)"
        ):
            validate(spec)


def test_run_steps_must_be_positive() -> None:
    with pytest.raises(DefinitionError, match=r"run.steps: Expected `int` >= 1"):
        loads(FAKE.read_text(), ["run.steps=0"])


def test_a_torch_generator_run_reports_a_small_logprob_mismatch(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    argv = ["run", str(TINY), "--metrics", str(metrics), "--no-progress", "--set", "run.steps=1"]
    assert main([*argv, "--set", f'objects.checkpointer.directory="{tmp_path / "ckpt"}"']) == 0
    (line,) = _steps(metrics)
    mismatch = line["logprob_mismatch"]
    assert isinstance(mismatch, float) and 0.0 <= mismatch < 1e-3, line
