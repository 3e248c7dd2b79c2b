"""``thundersync run FILE`` with ``[run.split]`` on three ranks: one rollout rank and two learner
ranks sharding the model (``[run] shard = true``: FSDP2 over the learners' group) reach the
one-process run of the same file without the split.

The file is examples/train_tiny_grpo.toml on an fp64 LoRA model (so the first learner
broadcasts the adapter's tensors only), two steps of two groups: the rollout rank (rank 0) deals
one group of each batch to each learner (ranks 1 and 2). The rollout rank samples with the
generate stage's own request seeds and ``TorchGenerator``'s counter-based sampling, so it samples
the tokens the one-process run samples when its weights are the learner's: step 2's tokens,
hence the second update, depend on the broadcast after step 1. The checkpoints are in the
distributed layout (``shard`` reaches the checkpointer; the one-process run writes it too), both
learners writing their shards: the adapter and the optimizer's state are compared. The first
launch also checks what a split writes: the first learner's metrics file (its step lines over
both learners' groups) and checkpoint, and each rank's summary line. A second launch resumes the
split run from its checkpoint of step 2 to step 3 with the roles moved (learners 0 and 1 load
the shards learners 1 and 2 wrote) and reaches the uninterrupted one-process run's step 3
(decisions 090, 091). A third launch (in the same test: the launches share the ranks' fork
server) runs the same placement on the tiny file turned into OPD: the learners score each
trajectory with the file's (fake) teacher and reach the one-process run (decision 094).

The ranks get the environment torchrun gives them (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, the
agent's store) and run ``main``, forked from a server that imported the command once: torchrun
would start an agent and a fresh interpreter per rank, each importing torch, transformers and
peft (on two cores, the slower way for three ranks). A ``gpu`` test runs 1 + 1 under torchrun on
two GPUs through NCCL, without the resume (``bash bench/gpu_multi.sh`` runs it); one learner rank
runs the same code as two, with a learner group of one. A replicated learner behind the split: tests/engine/test_split_distributed.py.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.app.cli.test_data_parallel import _relative_error
from thundersync.app.cli.command import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
ONE_LEARNER = "\n[run.split]\nrollout = [1]\nlearner = [0]\n"
TWO_LEARNERS = "\n[run.split]\nrollout = [0]\nlearner = [1, 2]\n"
LORA = 'objects.model.lora={r=4,lora_alpha=8,target_modules=["q_proj","v_proj"],lora_dropout=0.0}'


def _sets(out: Path, *extra: str) -> list[str]:
    items = ['objects.model.dtype="float64"', "stages.source.repeat=1", LORA, *extra]
    items.append(f'objects.checkpointer.directory="{out / "ckpt"}"')
    return [arg for item in items for arg in ("--set", item)]


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _one_process(
    tmp: Path, split: str, *extra: str, single_extra: tuple[str, ...] = (), text: str | None = None
) -> tuple[Path, list[str]]:
    """The file (``text``, else examples/train_tiny_grpo.toml) run in this process (into
    ``tmp/single``; ``single_extra``: its own ``--set``s); the one-process run's directory and the
    arguments of ``thundersync`` that run the file with ``split`` on every rank (into ``tmp``)."""
    tiny = text if text is not None else (ROOT / "examples" / "train_tiny_grpo.toml").read_text()
    (tmp / "tiny.toml").write_text(tiny)
    (tmp / "split.toml").write_text(tiny + split)
    single = tmp / "single"
    single.mkdir()
    argv = ["run", str(tmp / "tiny.toml"), "--metrics", str(single / "m.jsonl"), "--no-progress"]
    assert main([*argv, *_sets(single, *extra, *single_extra)]) == 0
    return single, [
        "run",
        str(tmp / "split.toml"),
        "--metrics",
        str(tmp / "m.jsonl"),
        "--no-progress",
        *_sets(tmp, *extra),
    ]


def _torchrun(tmp: Path, processes: int, argv: list[str]) -> str:
    """``torchrun --nproc-per-node PROCESSES -m thundersync ARGV``'s output; it must succeed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--standalone", "-m"]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "THUNDERSYNC_DIST_TIMEOUT_S": "60"}
    done = subprocess.run(
        [*command, "thundersync", *argv], cwd=tmp, env=environ, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


# What the fork server imports once for the ranks (the command, torch, transformers' Qwen3, peft)
PRELOAD = (
    "tests.app.cli.test_split_file_run",
    "transformers.models.qwen3.modeling_qwen3",
    "peft",
    "thundersync.app.cli.split",
    "thundersync.app.factories.training",
    "thundersync.engine.sharded",
    "thundersync.generation.torch_generator",
)


def _cli_rank(rank: int, world_size: int, port: int, argv: list[str], out: Any) -> None:
    """One rank of ``thundersync ARGV`` with what torchrun sets (its agent's store: the test's),
    its standard error kept."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS="1", THUNDERSYNC_DIST_TIMEOUT_S="60",
    )  # fmt: skip
    torch.set_num_threads(1)
    sys.stderr = error = io.StringIO()
    try:
        code: object = main(argv)
    except BaseException as failure:  # told to the test, which fails on it
        code = repr(failure)
    out.put((rank, code, error.getvalue()))


def _launched(processes: int, argv: list[str]) -> str:
    """``thundersync ARGV`` on ``processes`` ranks as torchrun starts them (its environment; the
    processes forked from a server that imported the command once: torchrun would start an agent
    and a fresh interpreter per rank); every rank's output, in rank order. Every rank must exit 0."""
    from tests.engine.test_distributed import _spawn

    results, codes, _ = _spawn(_cli_rank, processes, argv, preload=PRELOAD)
    outputs = {rank: (code, text) for rank, code, text in results}
    assert sorted(outputs) == list(range(processes)) and codes == [0] * processes, f"{codes}: {outputs}"
    assert all(code == 0 for code, _ in outputs.values()), outputs
    return "".join(outputs[rank][1] for rank in range(processes))


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "ckpt" / "step-00000002" / "adapter_model.safetensors")


def _distributed(directory: Path, step: int = 2) -> dict[str, torch.Tensor]:
    """The model's and the optimizer's tensors of a distributed-layout checkpoint, by name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = directory / f"whole-{step}.pt"
    dcp_to_torch_save(directory / "ckpt" / f"step-{step:08d}" / "distributed", whole)
    state = torch.load(whole, weights_only=False)
    tensors = {f"model/{name}": value for name, value in state["model"].items()}
    for name, values in state["optimizer"]["state"].items():
        tensors |= {f"optimizer/{name}/{key}": value for key, value in values.items() if key != "step"}
    return tensors


def test_grpo_and_opd_split_files_with_a_sharded_learner_reach_the_one_process_run(tmp_path: Path) -> None:
    """Steps 1 and 2 here; step 3, resumed from the split's checkpoint, and the same placement on
    an OPD file, in the helpers below (one test: the launches share the ranks' fork server)."""
    single, argv = _one_process(tmp_path, TWO_LEARNERS, "run.shard=true", single_extra=RESUMED_SINGLE)
    stderr = _launched(3, argv)
    _check_checkpoint(tmp_path, single, 2)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["run.json", "step-00000002"]
    lines, single_lines = _lines(tmp_path / "m.jsonl"), _lines(single / "m.jsonl")
    assert [r["event"] for r in lines] == ["run_started", "step", "step", "run_finished"]  # the first learner's
    assert lines[-1]["status"] == "ok"
    steps = [r for r in lines if r["event"] == "step"]
    single_steps = [r for r in single_lines if r["event"] == "step"][:2]
    assert [r["step"] for r in steps] == [1, 2] and [r["batch_id"] for r in steps] == [0, 1]
    for key in STEP_KEYS:
        assert [r[key] for r in steps] == pytest.approx([r[key] for r in single_steps], rel=1e-10), key
    assert set(steps[0]) == set(single_steps[0]) | {"groups_per_rank"}  # a one-process line's, and per learner
    assert [r["groups_per_rank"] for r in steps] == [[1, 1], [1, 1]]  # each learner learned one group of two
    assert all(r["generator_idle_s"] is None and r["rollout_s"] > 0 for r in steps)
    assert "thundersync: rank 1 of 3 (learner): 2 steps in " in stderr
    assert f"; metrics: {tmp_path / 'm.jsonl'}; checkpoints: {tmp_path / 'ckpt'}" in stderr
    assert "thundersync: rank 2 of 3 (learner): 2 steps in " in stderr
    assert "; no files (the first learner, rank 1, writes the metrics and checkpoints)" in stderr
    assert (
        "thundersync: rank 0 of 3 (rollout): 2 batches generated in " in stderr
        and "; no files (the first learner, rank 1, writes the metrics and checkpoints)" in stderr
    )
    _resumed_split_reaches_the_one_process_run(tmp_path, single, argv)
    (tmp_path / "opd").mkdir()
    _opd_split_reaches_the_one_process_run(tmp_path / "opd")


STEP_KEYS = ("tokens", "reward_mean", "reward_std", "grad_norm", "lr", "groups_rewarded")
RESUMED_SINGLE = ("run.steps=3", "objects.checkpointer.every=1")  # the uninterrupted run: 3 steps, step 2 kept
MOVED = "run.split={rollout=[2],learner=[0,1]}"


def _check_checkpoint(tmp: Path, single: Path, step: int) -> None:
    """The split's checkpoint of ``step`` holds the one-process run's adapter and optimizer state."""
    trained, want = _distributed(tmp, step), _distributed(single, step)
    assert sorted(trained) == sorted(want) and any("lora_B" in name for name in want)
    assert any(name.startswith("optimizer/") for name in want)  # the shards' optimizer state, reassembled
    for part in ("lora_", "optimizer/"):  # each on its own: the frozen base would hide an adapter's error
        names = [name for name in want if part in name]
        error = _relative_error({n: trained[n] for n in names}, {n: want[n] for n in names})
        assert error < 1e-10, f"step {step}, {part}: relative error {error:.3g}"
    assert all(torch.equal(trained[name], want[name]) for name in want if "lora_" not in name and "model/" in name)


def _resumed_split_reaches_the_one_process_run(tmp: Path, single: Path, argv: list[str]) -> None:
    """The split run of ``tmp`` (stopped after its checkpoint of step 2) resumed to step 3 with
    ``--resume``, its roles moved (learners 0 and 1 load the shards the learners 1 and 2 wrote;
    the first learner, now rank 0, writes), ends with the uninterrupted one-process run's step 3:
    the learners restore their state and tell the rollout rank the step, after which it samples
    batch 2 (not batch 0) on the restored weights (decision 091)."""
    stderr = _launched(3, [*argv, "--resume", str(tmp / "ckpt"), *_sets(tmp, "run.shard=true", "run.steps=3", MOVED)])
    _check_checkpoint(tmp, single, 3)
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
    assert "thundersync: rank 0 of 3 (learner): 1 steps in " in stderr
    assert "thundersync: rank 2 of 3 (rollout): 1 batches generated in " in stderr


OPD_KEYS = ("tokens", "reward_mean", "reward_std", "grad_norm", "lr", "reverse_kl")


def _opd_split_reaches_the_one_process_run(tmp_path: Path) -> None:
    """examples/train_tiny_grpo.toml turned into OPD (tests/app/test_deterministic_file.py: a fake
    teacher, whose log-prob of a token depends on the token and its position, scores every token;
    the reward stage is watched, not trained on) on one rollout rank and two learner ranks sharding
    the fp64 LoRA model: each learner scores its group of each batch with the teacher and streams
    it into OPD, and the run ends with the one-process run's adapter and optimizer state and its
    step lines (``reverse_kl`` over both learners' groups included; decision 094)."""
    from tests.app.test_deterministic_file import opd_text

    single, argv = _one_process(tmp_path, TWO_LEARNERS, "run.shard=true", text=opd_text())
    stderr = _launched(3, argv)
    _check_checkpoint(tmp_path, single, 2)
    steps = [r for r in _lines(tmp_path / "m.jsonl") if r["event"] == "step"]
    single_steps = [r for r in _lines(single / "m.jsonl") if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2] == [r["step"] for r in single_steps]
    assert all(isinstance(r["reverse_kl"], float) and r["reward_mean"] is not None for r in single_steps)
    for key in OPD_KEYS:
        assert [r[key] for r in steps] == pytest.approx([r[key] for r in single_steps], rel=1e-10), key
    for r, want in zip(steps, single_steps, strict=True):  # about 1e-16: the behaviour log-probs are the learner's
        assert abs(r["logprob_mismatch"] - want["logprob_mismatch"]) < 1e-10
    assert set(steps[0]) == set(single_steps[0]) | {"groups_per_rank"}
    assert [r["groups_per_rank"] for r in steps] == [[1, 1], [1, 1]]
    assert "thundersync: rank 0 of 3 (rollout): 2 batches generated in " in stderr


@pytest.mark.gpu
def test_a_split_file_on_two_gpus_through_nccl_reaches_the_one_process_run(tmp_path: Path) -> None:
    """The learner on cuda:0 and the rollout rank on cuda:1 (``device = "cuda"``: cuda:LOCAL_RANK),
    trajectories and weights through NCCL; the one-process run on cuda:0. fp64 on CUDA: 1e-8, as
    the data-parallel NCCL test."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    single, argv = _one_process(tmp_path, ONE_LEARNER, 'objects.model.device="cuda"')
    stderr = _torchrun(tmp_path, 2, argv)
    error = _relative_error(_adapter(tmp_path), _adapter(single))
    assert error < 1e-8, f"relative error {error:.3g}"
    assert "thundersync: rank 1 of 2 (rollout): 2 batches generated in " in stderr
