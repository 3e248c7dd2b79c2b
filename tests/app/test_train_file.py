"""A whole file trains: model -> run -> grpo -> optimizer -> schedule -> trainer, torch-generator, checkpointer."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

from thundersync.app.cli.command import main
from thundersync.app.factories import training

TINY = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_grpo.toml"


def _run(tmp_path: Path, *sets: str, resume: bool = False, file: Path = TINY) -> list[dict[str, Any]]:
    metrics = tmp_path / "m.jsonl"
    metrics.unlink(missing_ok=True)
    argv = ["run", str(file), "--metrics", str(metrics), "--no-progress"]
    argv += ["--set", f'objects.checkpointer.directory="{tmp_path / "ckpt"}"', "--set", "stages.source.repeat=1"]
    for item in sets:
        argv += ["--set", item]
    if resume:
        argv += ["--resume", str(tmp_path / "ckpt")]
    assert main(argv) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_the_tiny_grpo_file_trains_two_steps_on_its_schedule_and_checkpoints(tmp_path: Path) -> None:
    records = _run(tmp_path, "objects.schedule.warmup_steps=2")
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["grad_norm"]) and r["tokens"] > 0 for r in steps)
    warm = [training.schedule_factor(k, warmup_steps=2, decay_steps=4, floor_ratio=0.1) for k in range(2)]
    assert [r["lr"] for r in steps] == pytest.approx([3e-3 * f for f in warm])  # the trainer steps the schedule
    assert (tmp_path / "ckpt" / "step-00000002" / "checkpoint.json").is_file()


def test_run_resume_continues_a_file_from_its_checkpoint(tmp_path: Path) -> None:
    _run(tmp_path)
    state = torch.load(tmp_path / "ckpt" / "step-00000002" / "training_state.pt", weights_only=True)
    assert state["scheduler"] is not None  # the schedule is saved with the optimizer
    records = _run(tmp_path, "stages.source.repeat=2", resume=True)
    assert [r["step"] for r in records if r["event"] == "step"] == [3, 4]


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_run_that_fails_after_a_checkpoint_says_how_to_continue_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fail_at: int
) -> None:
    """A failure at step 2 (after step 1 was checkpointed) names step 1's checkpoint and the
    command that continues from it, which then runs step 2 as given (its metrics lines follow the
    first run's in the same file); a failure before any checkpoint says nothing."""
    from thundersync.app.checkpoints.checkpoint import Checkpointer

    real = Checkpointer.stepped

    async def stepped(self: Checkpointer, step: int, batch_id: object) -> None:
        if step == fail_at:
            raise RuntimeError(f"injected at step {step}")
        await real(self, step, batch_id)

    monkeypatch.setattr(Checkpointer, "stepped", stepped)
    ckpt = tmp_path / "ckpt"
    argv = ["run", str(TINY), "--metrics", str(tmp_path / "m.jsonl"), "--no-progress", "--overwrite"]
    argv += ["--set", f'objects.checkpointer.directory="{ckpt}"', "--set", "objects.checkpointer.every=1"]
    assert main([*argv, "--set", "stages.source.repeat=1"]) == 1
    err = capsys.readouterr().err
    assert f"failed: RuntimeError: injected at step {fail_at} (while handling BatchReady(" in err
    again = [word for word in argv if word != "--overwrite"] + [
        "--set",
        "stages.source.repeat=1",
        "--resume",
        str(ckpt),
    ]
    hint = f"step 1 is checkpointed in {ckpt / 'step-00000001'}; to continue from it, run: {shlex.join(['thundersync', *again])}\n"
    assert (hint in err) == (fail_at == 2), err
    if fail_at == 2:
        monkeypatch.setattr(Checkpointer, "stepped", real)
        assert main(shlex.split(hint.split("run: ", 1)[1])[1:]) == 0
        records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["event"] == "step"] == [1, 2]
        assert [r["status"] for r in records if r["event"] == "run_finished"] == ["failed", "ok"]


def test_a_resumed_run_that_fails_before_its_own_checkpoint_prints_no_resume_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Resuming again would repeat what just failed (a sandbox engine that is down...): no hint."""
    from thundersync.app.checkpoints.checkpoint import Checkpointer

    _run(tmp_path)

    async def stepped(self: Checkpointer, step: int, batch_id: object) -> None:
        raise RuntimeError(f"injected at step {step}")

    monkeypatch.setattr(Checkpointer, "stepped", stepped)
    capsys.readouterr()
    ckpt = tmp_path / "ckpt"
    argv = ["run", str(TINY), "--metrics", str(tmp_path / "m.jsonl"), "--no-progress", "--resume", str(ckpt)]
    argv += ["--set", f'objects.checkpointer.directory="{ckpt}"', "--set", "stages.source.repeat=2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "injected at step 3" in err and "checkpointed" not in err, err


def test_a_learner_process_trains_the_file_as_one_process_does(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    def train(where: Path, *sets: str) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
        where.mkdir()
        records = _run(where, "objects.trainer.audit_every=2", *sets)
        return [r for r in records if r["event"] == "step"], load_file(
            where / "ckpt" / "step-00000002" / "model.safetensors"
        )

    steps, weights = train(tmp_path / "one")
    child_steps, child_weights = train(
        tmp_path / "two", "objects.objective.process=true", 'objects.objective.process_env={ THUNDERSYNC_PROBE = "1" }'
    )
    for key in ("grad_norm", "logprob_mismatch", "reward_mean"):
        assert [r[key] for r in child_steps] == pytest.approx([r[key] for r in steps], rel=1e-5), key
    assert steps[0]["audit_rel_error"] is None is child_steps[0]["audit_rel_error"]
    assert child_steps[1]["audit_rel_error"] == pytest.approx(steps[1]["audit_rel_error"], rel=1e-3, abs=1e-9)
    assert child_steps[1]["audit_rel_error"] < 1e-5  # the audit ran (every second step) in the child
    assert weights.keys() == child_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(child_weights[name], tensor, rtol=1e-5, atol=1e-6)


def test_an_opd_file_trains_in_a_learner_process_as_in_one(tmp_path: Path) -> None:
    """The tiny file turned into OPD (a fake teacher scores every token; the teacher stage feeds
    the backward stage): ``process = true`` on its own copy of the parameters steps as one process does."""
    from safetensors.torch import load_file

    text = TINY.read_text()
    text = text.replace(
        'factory = "grpo"\nrun = { object = "run" }\nestimator = "grpo"', 'factory = "opd"\nrun = { object = "run" }'
    )
    text = text.replace("[objects.scorer]", '[objects.teacher]\nfactory = "test-fake-teacher"\n\n[objects.scorer]')
    text = text.replace(
        '[stages.backward]\ntype = "backward"\nreads = ["generate", "reward"]',
        '[stages.teacher]\ntype = "teacher-score"\nreads = ["generate"]\n\n'
        '[stages.backward]\ntype = "backward"\nreads = ["generate", "teacher"]',
    )
    text = text.replace('wait_for = ["reward", "backward"]', 'wait_for = ["teacher", "reward", "backward"]')
    text = text.replace(
        'reads = ["generate", "reward", "backward"]', 'reads = ["generate", "teacher", "reward", "backward"]'
    )
    opd = tmp_path / "tiny_opd.toml"
    opd.write_text(text)

    def train(name: str, *sets: str) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
        where = tmp_path / name
        where.mkdir()
        records = _run(where, *sets, file=opd)
        weights = load_file(where / "ckpt" / "step-00000002" / "model.safetensors")
        return [r for r in records if r["event"] == "step"], weights

    steps, weights = train("one")
    # the learner on its own copy of the parameters (process_device; on the CPU a private copy,
    # taken again at each batch): the second step's gradient comes from the weights after the first
    child_steps, child_weights = train(
        "two", "objects.objective.process=true", 'objects.objective.process_device="cpu"'
    )
    assert [r["step"] for r in steps] == [1, 2] and all(r["reverse_kl"] is not None for r in steps)
    for key in ("grad_norm", "reverse_kl", "logprob_mismatch"):
        assert [r[key] for r in child_steps] == pytest.approx([r[key] for r in steps], rel=1e-5), key
    for name, tensor in weights.items():
        torch.testing.assert_close(child_weights[name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_the_tiny_grpo_file_trains_on_cuda(tmp_path: Path) -> None:
    records = _run(tmp_path, "objects.model.device=cuda")
    assert [r["step"] for r in records if r["event"] == "step"] == [1, 2]
