"""``[run] deterministic = true``: two runs of a file, and a resumed run against the uninterrupted
one, end bitwise equal on CPU (fp64 and fp32 models), and the option reaches every object it concerns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from thundersync.app.cli.command import main
from thundersync.app.files.build import build_graph
from thundersync.app.files.definition import load
from thundersync.errors import DefinitionError
from thundersync.stages.backward import BackwardStage

TINY = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_grpo.toml"
_TIMES = {"t", "step_s", "rollout_s", "learn_s", "tokens_per_s", "generator_idle_s"}  # wall-clock fields


def opd_text() -> str:
    """The tiny file turned into OPD: a fake teacher scores every token, the teacher stage feeds backward."""
    text = TINY.read_text()
    for old, new in (
        ('factory = "grpo"\nrun = { object = "run" }\nestimator = "grpo"', 'factory = "opd"\nrun = { object = "run" }'),
        ("[objects.scorer]", '[objects.teacher]\nfactory = "test-fake-teacher"\n\n[objects.scorer]'),
        (
            '[stages.backward]\ntype = "backward"\nreads = ["generate", "reward"]',
            '[stages.teacher]\ntype = "teacher-score"\nreads = ["generate"]\n\n'
            '[stages.backward]\ntype = "backward"\nreads = ["generate", "teacher"]',
        ),
        ('wait_for = ["reward", "backward"]', 'wait_for = ["teacher", "reward", "backward"]'),
        ('reads = ["generate", "reward", "backward"]', 'reads = ["generate", "teacher", "reward", "backward"]'),
    ):
        assert old in text, old
        text = text.replace(old, new)
    return text


def _opd_file(directory: Path) -> Path:
    """:func:`opd_text` in ``directory``."""
    opd = directory / "tiny_opd.toml"
    opd.write_text(opd_text())
    return opd


def _run(
    directory: Path, dtype: str, *sets: str, resume: bool = False, metrics: str = "m.jsonl", file: Path = TINY
) -> list[dict[str, Any]]:
    directory.mkdir(parents=True, exist_ok=True)
    argv = ["run", str(file), "--metrics", str(directory / metrics), "--no-progress", "--set", "run.deterministic=true"]
    argv += [
        "--set",
        f'objects.checkpointer.directory="{directory / "ckpt"}"',
        "--set",
        f'objects.model.dtype="{dtype}"',
    ]
    for item in ("stages.source.repeat=1", "objects.checkpointer.every=1", *sets):
        argv += ["--set", item]
    if resume:
        argv += ["--resume", str(directory / "ckpt")]
    assert main(argv) == 0
    records = [json.loads(line) for line in (directory / metrics).read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in _TIMES} for r in records if r["event"] == "step"]


def _state(directory: Path, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The parameters and the optimizer/schedule state of ``step``'s checkpoint."""
    checkpoint = directory / "ckpt" / f"step-{step:08d}"
    return load_file(str(checkpoint / "model.safetensors")), torch.load(
        checkpoint / "training_state.pt", weights_only=True
    )


def _bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize(("objective", "dtype"), [("grpo", "float64"), ("grpo", "float32"), ("opd", "float64")])
def test_two_deterministic_runs_and_a_resumed_run_end_bitwise_equal(tmp_path: Path, objective: str, dtype: str) -> None:
    file = TINY if objective == "grpo" else _opd_file(tmp_path)
    first = _run(tmp_path / "first", dtype, file=file)
    second = _run(tmp_path / "second", dtype, file=file)
    assert [r["step"] for r in first] == [1, 2]
    assert first == second  # grad norms, rewards, log-prob mismatch, reverse KL, tokens: all but the clock's
    assert _bitwise_equal(_state(tmp_path / "first", 2), _state(tmp_path / "second", 2))
    stopped = _run(tmp_path / "resumed", dtype, "run.steps=1", file=file)
    resumed = _run(tmp_path / "resumed", dtype, resume=True, metrics="m2.jsonl", file=file)
    assert stopped + resumed == first
    assert _bitwise_equal(_state(tmp_path / "resumed", 2), _state(tmp_path / "first", 2))


def test_deterministic_reaches_the_run_the_generator_and_the_backward_stage() -> None:
    spec = load(TINY, ["run.deterministic=true"])
    graph = build_graph(spec)
    backward = graph["backward"].stage
    assert isinstance(backward, BackwardStage) and backward.config.ordered
    generator = graph["generate"].stage.generator  # type: ignore[attr-defined]
    assert generator.config.deterministic
    assert not backward.objective.run.worker.background  # type: ignore[attr-defined]
    default = build_graph(load(TINY))  # the default: arrival order, batched generation
    assert not default["backward"].stage.config.ordered  # type: ignore[attr-defined]
    assert not default["generate"].stage.generator.config.deterministic  # type: ignore[attr-defined]


def test_deterministic_refuses_the_options_that_depend_on_timing() -> None:
    with pytest.raises(DefinitionError, match=r"objects.run: streaming-run failed: background = true runs the engine"):
        build_graph(load(TINY, ["run.deterministic=true", "objects.run.background=true"]))
    with pytest.raises(DefinitionError, match=r"objects.objective: grpo failed: stream_early = true packs branches"):
        build_graph(load(TINY, ["run.deterministic=true", "objects.objective.stream_early=true"]))
