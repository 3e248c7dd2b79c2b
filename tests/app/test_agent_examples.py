"""The shipped agent files: the supervised warm-up, a short run of agent_grpo.toml and of agent_opd.toml
(its teacher the GRPO run's checkpoint), and agent_opd.toml without that checkpoint."""

from __future__ import annotations

import io
import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from tests.app.metrics.test_step_metrics import KEYS as STEP_KEYS
from thundersync.app.cli._terminal import Screen
from thundersync.app.cli.command import EXIT_INVALID, main
from thundersync.app.cli.progress import Progress
from thundersync.app.factories.models import model as build_model
from thundersync.app.factories.warmup import supervised_warmup, warmup_loss
from thundersync.app.phases import reporting
from thundersync.errors import ConfigError
from thundersync.sandboxes._process import unshare_available
from thundersync.sandboxes.local import NotIsolatedWarning
from thundersync.tasks import ArithmeticTasks, CalculatorDemonstrations

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHAPES = dict(
    vocab_size=257,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)
KEYS = STEP_KEYS - {"event"} | {"reverse_kl"}  # a step record without its JSON-lines "event" field
# A short run: a warm-up long enough that the model writes tool calls (on calculator episodes only:
# 40 steps on the files' half-and-half mix can leave a policy that never calls), one step of 2 groups x 4
SHORT = [
    "run.steps=1",
    "objects.demonstrations.direct_fraction=0",
    "objects.model.steps=40",
    "objects.model.lr=1e-2",
    "objects.model.batch_size=8",
    "objects.tasks.count=2",
    "stages.source.groups_per_batch=2",
    "stages.source.samples=4",
]


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # main() configures logging for the process, as a CLI does


def _demonstrations(count: int) -> CalculatorDemonstrations:
    tasks = ArithmeticTasks(count=count, seed=1, terms=2, operators=("*",), low=317, high=999)
    return CalculatorDemonstrations(tasks=tasks, end_token_id=256)


def test_the_warmup_lowers_the_loss_of_the_written_tokens_and_is_seeded(capsys: pytest.CaptureFixture[str]) -> None:
    demos = _demonstrations(8)
    batch = demos.demonstrations()
    models = [build_model(config=SHAPES, seed=0) for _ in range(2)]
    before = warmup_loss(models[0], batch, torch.device("cpu")).item()
    progress, shown = Progress(None), io.StringIO()
    progress.display = Screen(shown, progress.line, live=False)
    with reporting(progress):
        for built in models:
            warmed = supervised_warmup(model=built, demonstrations=demos, steps=6, batch_size=4, lr=1e-2, log_every=3)
            assert warmed is built
    assert warmup_loss(models[0], batch, torch.device("cpu")).item() < before - 1.0
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert not models[0].training and all(p.grad is None for p in models[0].parameters())
    lines = shown.getvalue().splitlines()
    assert len(lines) == 6 and lines[0] == "thundersync: warm-up 0/6 steps  elapsed 0:00:00"  # it started
    assert lines[1].startswith("thundersync: warm-up 3/6 steps") and " loss " in lines[1]
    assert lines[2].startswith("thundersync: warm-up 6/6 steps in ") and " ETA " not in lines[2]
    assert capsys.readouterr().err == ""  # the library prints nothing by itself


def test_a_cached_warmup_is_loaded_instead_of_trained_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cache: the first warm-up trains and keeps its weights; the same warm-up of a model built
    the same way loads them (trains nothing, equal weights); another setting, other starting
    weights or other trained parameters train again, each to a file of its own; a file that is a
    link is refused."""
    import thundersync.app.factories.warmup as warmup

    demos, cache = _demonstrations(8), tmp_path / "cache"
    settings = dict(demonstrations=demos, steps=4, batch_size=4, lr=1e-2, cache=str(cache))
    first = supervised_warmup(model=build_model(config=SHAPES, seed=0), **settings)  # type: ignore[arg-type]
    (written,) = cache.glob("*.safetensors")
    trained = []
    monkeypatch.setattr(warmup, "warmup_loss", lambda *a: trained.append(1) or warmup_loss(*a))
    progress, shown = Progress(None), io.StringIO()
    progress.display = Screen(shown, progress.line, live=False)
    with reporting(progress):
        again = supervised_warmup(model=build_model(config=SHAPES, seed=0), **settings)  # type: ignore[arg-type]
    assert not trained and not again.training
    assert shown.getvalue().splitlines()[-1].startswith("thundersync: warm-up 1/1 file in ")
    assert shown.getvalue().splitlines()[-1].endswith(f"  cached {written}")  # no rate of files per second
    assert "/s" not in shown.getvalue().splitlines()[-1].removesuffix(f"  cached {written}")
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True))
    assert not all(
        torch.equal(a, b) for a, b in zip(first.parameters(), build_model(config=SHAPES, seed=0).parameters())
    )
    supervised_warmup(model=build_model(config=SHAPES, seed=0), **{**settings, "lr": 2e-2})  # type: ignore[arg-type]
    assert len(trained) == 4
    supervised_warmup(model=build_model(config=SHAPES, seed=1), **settings)  # type: ignore[arg-type]
    frozen = build_model(config=SHAPES, seed=0)
    frozen.get_input_embeddings().requires_grad_(False)
    supervised_warmup(model=frozen, **settings)  # type: ignore[arg-type]
    assert len(trained) == 12 and len(list(cache.glob("*.safetensors"))) == 4 and not list(cache.glob(".*"))
    written.rename(tmp_path / "moved")
    written.symlink_to(tmp_path / "moved")
    with pytest.raises(ConfigError, match=r"the warm-up cache file .* cannot be read \(.*\); remove it"):
        supervised_warmup(model=build_model(config=SHAPES, seed=0), **settings)  # type: ignore[arg-type]


def test_the_warmup_needs_demonstrations_and_parameters_to_train() -> None:
    class _None:
        def demonstrations(self) -> list[Any]:
            return []

    with pytest.raises(ConfigError, match=r"the warm-up's demonstrations object listed none"):
        supervised_warmup(model=build_model(config=SHAPES), demonstrations=_None())
    frozen = build_model(config=SHAPES).requires_grad_(False)
    with pytest.raises(ConfigError, match=r"the warm-up's model has no trainable parameter"):
        supervised_warmup(model=frozen, demonstrations=_demonstrations(1))


def _run(tmp_path: Path, name: str, *sets: str) -> list[dict[str, Any]]:
    metrics = tmp_path / f"{name}.jsonl"
    argv = ["run", str(EXAMPLES / f"{name}.toml"), "--metrics", str(metrics), "--no-progress", "--overwrite"]
    for item in (f'objects.checkpointer.directory="{tmp_path / name}"', *SHORT, *sets):
        argv += ["--set", item]
    assert main(argv) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A short run of agent_grpo.toml: its directory and its metrics records."""
    problem = unshare_available()
    if problem is not None:
        pytest.skip(f"the example's local sandbox backend cannot run here: {problem}")
    tmp_path = tmp_path_factory.mktemp("agent")
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore", NotIsolatedWarning)  # the example's local backend says it is no isolation
        patch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(tmp_path / "scratch"))
        records = _run(tmp_path, "agent_grpo")
        structlog.reset_defaults()
    return tmp_path, records


@pytest.mark.slow
def test_agent_grpo_runs_a_step_that_calls_the_calculator_and_checkpoints(
    grpo_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    tmp_path, records = grpo_run
    (step,) = [r for r in records if r["event"] == "step"]
    assert step.keys() >= KEYS and step["step"] == 1 and step["reverse_kl"] is None
    assert step["tool_calls"] > 0 and 0.0 <= step["reward_mean"] <= 1.0 and math.isfinite(step["grad_norm"])
    assert (tmp_path / "agent_grpo" / "step-00000001" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::thundersync.sandboxes.local.NotIsolatedWarning")
def test_agent_opd_distils_the_grpo_checkpoint_and_reports_the_reverse_kl(
    grpo_run: tuple[Path, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path, _ = grpo_run
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(tmp_path / "scratch"))
    records = _run(tmp_path, "agent_opd", f'objects.teacher.path="{tmp_path / "agent_grpo"}"')
    (step,) = [r for r in records if r["event"] == "step"]
    assert step.keys() >= KEYS and step["tool_calls"] > 0
    assert math.isfinite(step["reverse_kl"]) and step["reward_mean"] is not None


def test_agent_opd_without_the_grpo_checkpoint_says_to_train_it_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", str(EXAMPLES / "agent_opd.toml"), "--metrics", str(tmp_path / "m.jsonl")]
    argv += ["--set", f'objects.teacher.path="{tmp_path / "runs" / "agent_grpo"}"']
    assert main(argv) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "holds no checkpoint" in err and "thundersync run examples/agent_grpo.toml" in err
    assert "warm-up" not in err  # it failed before training anything


def test_reverse_kl_pairs_each_actions_scored_behaviour_log_probs_with_its_teachers_in_either_order() -> None:
    from thundersync.app.metrics.step_metrics import StepMetrics
    from thundersync.events import ActionGenerated, StepDone, TeacherScored

    metrics = StepMetrics(clock=lambda: 0.0)
    events = [
        ActionGenerated(
            group_id="b",
            trajectory_id=0,
            turn=0,
            token_ids=[1, 2, 3],
            behaviour_logprobs=[-1.0, -2.0, -3.0],
            scored=[True, False, True],
        ),
        TeacherScored(group_id="b", trajectory_id=0, turn=0, teacher_logprobs=[-1.5, -2.0]),  # 0.5, -1.0
        TeacherScored(group_id="b", trajectory_id=0, turn=1, teacher_logprobs=[-0.5]),  # before its action
        ActionGenerated(group_id="b", trajectory_id=0, turn=1, token_ids=[4], behaviour_logprobs=[-0.25]),  # 0.25
    ]
    assert all(metrics.observe(event) is None for event in events)
    record = metrics.observe(StepDone(batch_id="b", policy_version=1))
    assert record is not None and record["reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.25) / 3)
