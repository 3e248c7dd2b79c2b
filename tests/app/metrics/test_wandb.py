"""``[run.wandb]``: the run's config once, every numeric step and eval key as a W&B metric; offline works."""

from __future__ import annotations

import json
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from thundersync.app.cli.command import main
from thundersync.app.metrics.jsonl import JsonlMetrics
from thundersync.app.metrics.wandb import WandbSettings, WandbSteps

ROOT = Path(__file__).resolve().parents[3]
FAKE = ROOT / "examples" / "pipeline_fake.toml"


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # main() configures logging for the process, as a CLI does


class _FakeRun:
    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    def log(self, values: dict[str, Any], step: int) -> None:
        self.calls.append(("log", (step, values)))

    def finish(self, exit_code: int) -> None:
        self.calls.append(("finish", exit_code))


def _fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    module = types.ModuleType("wandb")
    module.Settings = lambda **kw: kw  # type: ignore[attr-defined]

    def init(**kwargs: Any) -> _FakeRun:
        calls.append(("init", kwargs))
        return _FakeRun(calls)

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_the_config_goes_once_and_every_numeric_step_key_at_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_wandb(monkeypatch)
    sink = WandbSteps(WandbSettings(project="p", mode="offline", tags=("a",)), config={"stages": {"x": 1}})
    with JsonlMetrics(None, sinks=[sink]) as metrics:
        metrics.write("step", step=1, reward_mean=0.5, tokens=7, audit_rel_error=None, groups_per_rank=[1], ok=True)
        metrics.write("eval", step=1, eval_pass_at_k=0.25)
        metrics.write("GroupClosed", group_id=3)  # not a record: not logged
    (kind, init), *rest = calls
    assert kind == "init" and init["config"] == {"stages": {"x": 1}} and init["project"] == "p"
    assert init["mode"] == "offline" and init["tags"] == ["a"]
    assert rest == [
        ("log", (1, {"reward_mean": 0.5, "tokens": 7})),
        ("log", (1, {"eval_pass_at_k": 0.25})),
        ("finish", 0),
    ]


def test_a_failed_run_finishes_its_wandb_run_with_exit_code_1(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_wandb(monkeypatch)
    with pytest.raises(RuntimeError), JsonlMetrics(None, sinks=[WandbSteps(WandbSettings())]):
        raise RuntimeError("boom")
    assert calls[-1] == ("finish", 1)


@pytest.mark.slow
def test_an_offline_run_needs_no_network_and_holds_the_steps_and_the_config(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    argv = ["run", str(FAKE), "--no-progress", "--metrics", str(tmp_path / "m.jsonl"), "--set", "run.steps=2"]
    argv += ["--set", f'run.wandb = {{ mode = "offline", dir = "{tmp_path}", project = "distinct-project" }}']
    assert main(argv) == 0
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    for _ in range(100):  # wandb's service writes the offline file after finish() returns
        if b"reward_mean" in (data := log.read_bytes()):
            break
        time.sleep(0.1)
    steps = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s["event"] == "step"] == [1, 2]
    for key in (b"reward_mean", b"grad_norm", b"tokens_per_s", b"distinct-project", b"test-scripted-generator"):
        assert key in data  # metrics, the project, and the file's objects in the config


def test_without_the_wandb_package_check_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main(["check", str(FAKE), "--set", 'run.wandb = { mode = "offline" }']) == 1  # as for tensorboard
    assert "run.wandb needs the 'wandb' extra" in capsys.readouterr().err


def test_an_unknown_wandb_setting_is_a_path_qualified_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(FAKE), "--set", 'run.wandb = { projct = "x" }']) == 2
    assert "run.wandb.projct: unknown field; valid fields: project, name" in capsys.readouterr().err
