"""``[eval]``: held-out evaluation every N steps and at the end, and ``thundersync eval`` alone."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from thundersync.app.cli.command import main
from thundersync.app.evaluation import eval_record, pass_at_k
from thundersync.app.files.check import check_pipeline
from thundersync.app.files.definition import loads
from thundersync.errors import DefinitionError

ROOT = Path(__file__).resolve().parents[3]
HELD_OUT = [[51, 52, 53], [61, 62], [71, 72, 73]]


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # main() configures logging for the process, as a CLI does


def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_pass() -> None:
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 7)
        passed = [rng.random() < 0.4 for _ in range(n)]
        for k in range(1, n + 1):
            draws = list(itertools.combinations(passed, k))
            exact = sum(any(draw) for draw in draws) / len(draws)
            assert abs(pass_at_k(n, sum(passed), k) - exact) < 1e-12
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_an_eval_record_averages_rewards_and_passes_over_the_tasks() -> None:
    record = eval_record(
        {"a": [1.0, 0.0], "b": [0.0, 0.0], "c": [1.0, 1.0]}, k=2, pass_threshold=1.0, tokens=9, seconds=2
    )
    assert record["eval_reward_mean"] == 0.5 and record["eval_pass_at_1"] == 0.5
    assert record["eval_pass_at_k"] == 2 / 3 and (record["eval_k"], record["eval_tasks"], record["eval_samples"]) == (
        2,
        3,
        2,
    )
    assert record["eval_tokens"] == 9 and record["eval_s"] == 2


def _file(tmp_path: Path, evaluation: str | None, *, name: str = "run") -> Path:
    """examples/train_tiny_grpo.toml writing into ``tmp_path``, with ``[eval]`` when given."""
    text = (ROOT / "examples" / "train_tiny_grpo.toml").read_text()
    text = text.replace('directory = "runs/train_tiny_grpo"', f'directory = "{tmp_path / name}"')
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"prompt_ids": ids, "answer": "x"}) + "\n" for ids in HELD_OUT))
    if evaluation is not None:
        text += f'\n[objects.heldout]\nfactory = "jsonl-tasks"\npath = "{heldout}"\n\n[eval]\n{evaluation}\n'
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def _lines(path: Path, event: str) -> list[dict[str, Any]]:
    return [r for line in path.read_text().splitlines() if (r := json.loads(line))["event"] == event]


def _run(file: Path, metrics: Path, *extra: str) -> int:
    return main(["run", str(file), "--metrics", str(metrics), "--no-progress", "--set", "run.steps=3", *extra])


@pytest.mark.slow
def test_a_run_evaluates_every_n_steps_and_at_the_end_without_touching_training(tmp_path: Path) -> None:
    plain, evaluated = tmp_path / "plain.jsonl", tmp_path / "evaluated.jsonl"
    assert _run(_file(tmp_path, None, name="plain"), plain) == 0
    settings = 'tasks = "heldout"\nevery = 2\nsamples = 4\ntemperature = 1.0\nk = 2\npass_threshold = 0.5'
    assert _run(_file(tmp_path, settings, name="evaluated"), evaluated) == 0
    evals = _lines(evaluated, "eval")
    assert [e["step"] for e in evals] == [2, 3]  # every 2 steps, and at the end
    for record in evals:
        assert record["eval_tasks"] == 3 and record["eval_samples"] == 4 and record["eval_k"] == 2
        assert 0 <= record["eval_reward_mean"] <= 1 and 0 <= record["eval_pass_at_1"] <= record["eval_pass_at_k"] <= 1
        assert record["eval_tokens"] > 0
    keys = ("reward_mean", "reward_std", "tokens", "grad_norm", "lr", "tool_calls")
    assert [{k: s[k] for k in keys} for s in _lines(plain, "step")] == [
        {k: s[k] for k in keys} for s in _lines(evaluated, "step")
    ]  # the training never saw the evaluation
    weights = [p.read_bytes() for p in sorted((tmp_path / "plain").rglob("model.safetensors"))]
    assert weights == [p.read_bytes() for p in sorted((tmp_path / "evaluated").rglob("model.safetensors"))]


@pytest.mark.slow
def test_thundersync_eval_on_a_checkpoint_repeats_the_runs_last_evaluation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = _file(tmp_path, 'tasks = "heldout"\nsamples = 2\ntemperature = 0.0')  # greedy
    assert _run(file, tmp_path / "run.jsonl") == 0
    (last,) = _lines(tmp_path / "run.jsonl", "eval")
    capsys.readouterr()
    assert (
        main(["eval", str(file), "--checkpoint", str(tmp_path / "run"), "--metrics", str(tmp_path / "eval.jsonl")]) == 0
    )
    (alone,) = _lines(tmp_path / "eval.jsonl", "eval")
    assert alone["step"] == last["step"] == 3
    assert {k: v for k, v in alone.items() if k not in ("t", "eval_s")} == {
        k: v for k, v in last.items() if k not in ("t", "eval_s")
    }
    out = capsys.readouterr().out
    assert f"{file}: step 3: eval_reward_mean" in out and "(k = 2; 3 tasks x 2 samples in" in out


def test_eval_without_an_eval_table_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(_file(tmp_path, None))]) == 2
    assert "the file has no [eval] table" in capsys.readouterr().err


def _checked(tmp_path: Path, evaluation: str, stages: str = "") -> None:
    text = _file(tmp_path, evaluation).read_text() + stages
    check_pipeline(loads(text))


@pytest.mark.parametrize(
    ("evaluation", "message"),
    [
        ('tasks = "nope"', r"eval.tasks: names 'nope', which is not an object of the file"),
        ('tasks = "model"', r"eval.tasks: references 'model', a 'model' object that makes a Module"),
        ('tasks = "heldout"\nsamples = 2\nk = 3', r"eval.k: 3 is more than eval.samples = 2"),
        ('tasks = "heldout"\nstage = "reward"', r"eval.stage: 'reward' is not a generate or agent-app stage"),
        ('tasks = "heldout"\nscorer = "policy"', r"eval.scorer: 'policy' makes a PolicyClock"),
        ('tasks = "heldout"\nsample = 2', r"eval.sample: unknown field; valid fields: tasks, every"),
    ],
)
def test_check_validates_the_eval_table(tmp_path: Path, evaluation: str, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        _checked(tmp_path, evaluation)


def test_check_accepts_a_valid_eval_table(tmp_path: Path) -> None:
    _checked(tmp_path, 'tasks = "heldout"\nevery = 2\nsamples = 4\nk = 2\nscorer = "scorer"')


class _Counting:
    """Stands for an Evaluation: records the steps it ran at."""

    def __init__(self, every: int, at_end: bool) -> None:
        from thundersync.app.files.definition import EvalSettings

        self.settings = EvalSettings(tasks="t", every=every, at_end=at_end)
        self.steps: list[int] = []

    async def run(self, step: int) -> dict[str, Any]:
        self.steps.append(step)
        return {"step": step}


@pytest.mark.parametrize(
    ("every", "at_end", "last", "expected"),
    [(2, True, 4, [2, 4]), (2, True, 5, [2, 4, 5]), (0, True, 3, [3]), (3, False, 7, [3, 6]), (0, False, 2, [])],
)
def test_the_hook_evaluates_every_n_steps_and_once_at_the_end(
    every: int, at_end: bool, last: int, expected: list[int]
) -> None:
    import anyio

    from thundersync.app.evaluation import EvalHook

    evaluation, written = _Counting(every, at_end), []

    async def steps() -> None:
        hook = EvalHook(evaluation, written.append)  # type: ignore[arg-type]
        for step in range(1, last + 1):
            await hook.stepped(step, step - 1)
        await hook.finished(last)

    anyio.run(steps)
    assert evaluation.steps == expected and [r["step"] for r in written] == expected


@pytest.mark.slow
def test_an_agent_app_file_evaluates_through_a_copy_of_its_app_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("openai")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    argv = ["run", "examples/openai_agent.toml", "--no-progress", "--metrics", "m.jsonl", "--set", "run.steps=2"]
    assert main([*argv, "--set", "stages.app.max_new_tokens=8"]) == 0
    (record,) = _lines(tmp_path / "m.jsonl", "eval")
    assert record["step"] == 2 and record["eval_tasks"] == 4 and record["eval_samples"] == 2
    assert record["eval_tokens"] > 0 and record["eval_reward_mean"] is not None  # the app's own rewards
