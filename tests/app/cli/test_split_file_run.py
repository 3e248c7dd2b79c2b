"""``torchrun --nproc-per-node 2 -m thundersync run FILE`` with ``[run.split]``: one rollout rank
and one learner rank reach the one-process run of the same file without the split.

The file is examples/train_tiny_grpo.toml on an fp64 LoRA model (so the learner broadcasts the
adapter's tensors only), two steps of two groups. The rollout rank samples with the generate
stage's own request seeds and ``TorchGenerator``'s counter-based sampling, so it samples the
tokens the one-process run samples when its weights are the learner's: step 2's tokens, hence
the second update, depend on the broadcast after step 1. The first spawned run also checks what a
split writes: the learner's metrics file and checkpoint, and each rank's summary line. This test
replaces the 1 rollout + 1 learner LoRA case of tests/engine/test_split_distributed.py (the same
path, from the Python API). A second launch resumes the split run from its checkpoint of step 2 to
step 3, its roles swapped, and reaches the uninterrupted one-process run's step 3 (decision 091).
A ``gpu`` test runs the first launch on two GPUs through NCCL, without the resume
(``bash bench/gpu_multi.sh`` runs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.app.cli.test_data_parallel import _relative_error
from thundersync.app.cli.command import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
SPLIT = "\n[run.split]\nrollout = [1]\nlearner = [0]\n"
LORA = 'objects.model.lora={r=4,lora_alpha=8,target_modules=["q_proj","v_proj"],lora_dropout=0.0}'


def _sets(out: Path, *extra: str) -> list[str]:
    items = ['objects.model.dtype="float64"', "stages.source.repeat=1", LORA, *extra]
    items.append(f'objects.checkpointer.directory="{out / "ckpt"}"')
    return [arg for item in items for arg in ("--set", item)]


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _split_and_one_process(
    tmp: Path, *extra: str, single_extra: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The file run in this process (into ``tmp/single``; ``single_extra``: its own ``--set``s),
    then split under torchrun (into ``tmp``); the torchrun's outcome and the one-process run's directory."""
    tiny = (ROOT / "examples" / "train_tiny_grpo.toml").read_text()
    (tmp / "tiny.toml").write_text(tiny)
    (tmp / "split.toml").write_text(tiny + SPLIT)
    single = tmp / "single"
    single.mkdir()
    argv = ["run", str(tmp / "tiny.toml"), "--metrics", str(single / "m.jsonl"), "--no-progress"]
    assert main([*argv, *_sets(single, *extra, *single_extra)]) == 0
    return _torchrun(tmp, *_sets(tmp, *extra)), single


def _torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``split.toml`` under torchrun on 2 ranks, its metrics in ``tmp/m.jsonl``; it must succeed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m"]
    command += ["thundersync", "run", str(tmp / "split.toml"), "--metrics", str(tmp / "m.jsonl")]
    command += ["--no-progress", *args]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "THUNDERSYNC_DIST_TIMEOUT_S": "60"}
    done = subprocess.run(command, cwd=tmp, env=environ, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _adapter(directory: Path, step: int = 2) -> dict[str, torch.Tensor]:
    return load_file(directory / "ckpt" / f"step-{step:08d}" / "adapter_model.safetensors")


def test_a_split_file_under_torchrun_reaches_the_one_process_run_and_writes_its_files(tmp_path: Path) -> None:
    """Steps 1 and 2 here; step 3, resumed from the split's checkpoint, in the test below's helper."""
    done, single = _split_and_one_process(tmp_path, single_extra=RESUMED_SINGLE)
    error = _relative_error(_adapter(tmp_path), _adapter(single))
    assert error < 1e-10, f"relative error {error:.3g}"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["run.json", "step-00000002"]
    lines, single_lines = _lines(tmp_path / "m.jsonl"), _lines(single / "m.jsonl")
    assert [r["event"] for r in lines] == ["run_started", "step", "step", "run_finished"]  # the learner's alone
    assert lines[-1]["status"] == "ok"
    steps = [r for r in lines if r["event"] == "step"]
    single_steps = [r for r in single_lines if r["event"] == "step"][:2]
    assert [r["step"] for r in steps] == [1, 2] and [r["batch_id"] for r in steps] == [0, 1]
    for key in STEP_KEYS:
        assert [r[key] for r in steps] == pytest.approx([r[key] for r in single_steps], rel=1e-10), key
    assert set(steps[0]) == set(single_steps[0])  # the same fields as a one-process run's step line
    assert all(r["generator_idle_s"] is None and r["rollout_s"] > 0 for r in steps)
    assert "thundersync: rank 0 of 2 (learner): 2 steps in " in done.stderr
    assert f"; metrics: {tmp_path / 'm.jsonl'}; checkpoints: {tmp_path / 'ckpt'}" in done.stderr
    assert (
        "thundersync: rank 1 of 2 (rollout): 2 batches generated in " in done.stderr
        and "; no files (the learner, rank 0, writes the metrics and checkpoints)" in done.stderr
    )
    _resumed_split_reaches_the_one_process_run(tmp_path, single)


STEP_KEYS = ("tokens", "reward_mean", "reward_std", "grad_norm", "lr", "groups_rewarded")
RESUMED_SINGLE = ("run.steps=3", "objects.checkpointer.every=1")  # the uninterrupted run: 3 steps, step 2 kept
SWAPPED = "run.split={rollout=[0],learner=[1]}"


def _resumed_split_reaches_the_one_process_run(tmp: Path, single: Path) -> None:
    """The split run of ``tmp`` (stopped after its checkpoint of step 2) resumed to step 3 with
    ``--resume``, its roles swapped (a checkpoint does not depend on the placement; the learner, now
    rank 1, writes), ends with the adapter and step line of the uninterrupted one-process run's step
    3: the learner restores its state and tells the rollout rank its step, after which the rollout
    rank samples batch 2 (not batch 0) on the restored weights."""
    done = _torchrun(tmp, "--resume", str(tmp / "ckpt"), *_sets(tmp, "run.steps=3", SWAPPED))
    error = _relative_error(_adapter(tmp, 3), _adapter(single, 3))
    assert error < 1e-10, f"relative error {error:.3g}"
    runs = {
        json.loads((tmp / "ckpt" / name / "checkpoint.json").read_text())["run"]
        for name in ("step-00000002", "step-00000003")
    }
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == ["run.json", "step-00000002", "step-00000003"]
    assert len(runs) == 1  # the resumed run continues the split's run
    lines, single_lines = _lines(tmp / "m.jsonl"), _lines(single / "m.jsonl")
    events = ["run_started", "step", "step", "run_finished"]
    assert [r["event"] for r in lines] == [*events, "run_started", "step", "run_finished"]  # added to the file
    steps = [r for r in lines if r["event"] == "step"]
    single_steps = [r for r in single_lines if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["batch_id"] for r in steps] == [0, 1, 2]
    for key in STEP_KEYS:
        assert [r[key] for r in steps] == pytest.approx([r[key] for r in single_steps], rel=1e-10), key
    assert "thundersync: rank 1 of 2 (learner): 1 steps in " in done.stderr
    assert "thundersync: rank 0 of 2 (rollout): 1 batches generated in " in done.stderr


@pytest.mark.gpu
def test_a_split_file_on_two_gpus_through_nccl_reaches_the_one_process_run(tmp_path: Path) -> None:
    """The learner on cuda:0 and the rollout rank on cuda:1 (``device = "cuda"``: cuda:LOCAL_RANK),
    trajectories and weights through NCCL; the one-process run on cuda:0. fp64 on CUDA: 1e-8, as
    the data-parallel NCCL test."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    done, single = _split_and_one_process(tmp_path, 'objects.model.device="cuda"')
    error = _relative_error(_adapter(tmp_path), _adapter(single))
    assert error < 1e-8, f"relative error {error:.3g}"
    assert "thundersync: rank 1 of 2 (rollout): 2 batches generated in " in done.stderr
