"""``torchrun -m thundersync run FILE``: two gloo ranks reach the single-process run's parameters.

The tests launch ``python -m torch.distributed.run --nproc-per-node 2 --standalone -m thundersync
run`` on the tiny GRPO file (fp64 model, 3 groups per batch, so the ranks' shares are uneven and
decided at run time) and compare the final checkpoint with the single-process run's. The file
gets an admission of one group in flight, so a rank claims a group only when it has room and
both ranks take part (without one, each rank may have its share of a batch in flight: 2 of 3
groups). Rollouts are
a pure function of (seed, group, trajectory, turn) and the weights (``GenerateStage`` derives each
request's seed from its ids, ``TorchGenerator``'s sampling is counter-based), so a group samples
the same tokens whichever rank claims it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from thundersync.app.cli.command import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
ADMISSION = '\n[objects.admission]\nfactory = "admission"\nmax_groups = 1\n'
SHARD = "objects.optimizer.shard_state=true"
SLOW_REWARD = (
    'objects.scorer.factory="function-reward"',
    'objects.scorer.function="tests.app.rank_rewards:slow_even_tokens"',
    "objects.scorer.text=false",
)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """examples/train_tiny_grpo.toml with an admission object."""
    path = tmp_path / "tiny.toml"
    path.write_text((ROOT / "examples" / "train_tiny_grpo.toml").read_text() + ADMISSION)
    return path


@pytest.fixture
def unbounded(tmp_path: Path) -> Path:
    """examples/train_tiny_grpo.toml as it is: no admission object."""
    path = tmp_path / "tiny.toml"
    path.write_text((ROOT / "examples" / "train_tiny_grpo.toml").read_text())
    return path


def _sets(tmp: Path, repeat: int, *extra: str, per_batch: int = 3) -> list[str]:
    """Overrides: an fp64 model, ``repeat`` epochs of the file's 4 prompts, ``per_batch`` groups per batch."""
    items = ['objects.model.dtype="float64"', f"stages.source.groups_per_batch={per_batch}"]
    items += [f"stages.source.repeat={repeat}", f'objects.checkpointer.directory="{tmp / "ckpt"}"', *extra]
    return [arg for item in items for arg in ("--set", item)]


def _torchrun(tmp: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 240) -> Any:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    command += [
        "-m",
        "thundersync",
        "run",
        str(tmp / "tiny.toml"),
        "--metrics",
        str(tmp / "m.jsonl"),
        "--no-progress",
        *args,
    ]
    environ = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "THUNDERSYNC_DIST_TIMEOUT_S": "60",
        **(env or {}),
    }
    return subprocess.run(command, cwd=tmp, env=environ, capture_output=True, text=True, timeout=timeout)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    num = sum(float((got[k] - want[k]).pow(2).sum()) for k in want) ** 0.5
    return num / sum(float(w.pow(2).sum()) for w in want.values()) ** 0.5


def _single_process(tmp: Path, per_batch: int, *extra: str, repeat: int = 2) -> Path:
    """The final checkpoint of the one-process run of ``repeat`` epochs (4 groups each)."""
    tmp.mkdir()
    argv = [
        "run",
        str(tmp.parent / "tiny.toml"),
        "--metrics",
        str(tmp / "m.jsonl"),
        "--no-progress",
        *_sets(tmp, repeat, *extra, per_batch=per_batch),
    ]
    assert main(argv) == 0
    (last,) = (tmp / "ckpt").glob("step-*")
    return last


def test_two_ranks_from_the_command_line_reach_the_single_process_parameters(tmp_path: Path, tiny: Path) -> None:
    """8 groups in batches of 3, 3, 2: the ranks' shares are uneven and decided as they run."""
    want = _single_process(tmp_path / "single", per_batch=3)
    done = _torchrun(tmp_path, *_sets(tmp_path, 2))
    assert done.returncode == 0, done.stderr[-3000:]
    error = _relative_error(_weights(tmp_path / "ckpt" / "step-00000003"), _weights(want))
    assert error < 1e-10, f"relative error {error:.3g}"
    assert "thundersync: rank 1 of 2: 3/3 steps in" in done.stderr
    assert "no files (rank 0 writes the metrics and checkpoints)" in done.stderr
    assert "thundersync: rank 0 of 2: 3/3 steps in" in done.stderr
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["event"] == "step"] == [1, 2, 3]
    assert [r["status"] for r in lines if r["event"] == "run_finished"] == ["ok"]  # one writer
    single = [json.loads(line) for line in (tmp_path / "single" / "m.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["event"] == "step"]
    single_steps = [r for r in single if r["event"] == "step"]
    for key in ("tokens", "reward_mean", "reward_std", "tool_calls"):  # the whole batch's, gathered from the ranks
        assert [r[key] for r in steps] == pytest.approx([r[key] for r in single_steps], rel=1e-12), key
    assert [sum(r["groups_per_rank"]) for r in steps] == [3, 3, 2]
    assert sum(r["groups_per_rank"][1] for r in steps) > 0, "rank 1 took no group"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["run.json", "step-00000003"]


def _optimizer_state(checkpoint: Path) -> dict[int, dict[str, torch.Tensor]]:
    state: dict[int, dict[str, torch.Tensor]] = torch.load(checkpoint / "training_state.pt")["optimizer"]["state"]
    return state


def test_two_ranks_with_sharded_optimizer_state_reach_the_single_process_parameters_and_state(
    tmp_path: Path, tiny: Path
) -> None:
    """``shard_state = true``: ZeRO-1, each rank keeps the AdamW state of its part of the parameters;
    the checkpoint gathers the whole state on rank 0 (the single process's, to 1e-10)."""
    want = _single_process(tmp_path / "single", per_batch=3)
    done = _torchrun(tmp_path, *_sets(tmp_path, 2, SHARD), "--verbose")
    assert done.returncode == 0, done.stderr[-3000:]
    shards = re.findall(r"event='optimizer_sharded' parameters='(\d+) of (\d+)' rank=(\d)", done.stderr)
    assert sorted(rank for _, _, rank in shards) == ["0", "1"], done.stderr[-3000:]
    assert sum(int(here) for here, _, _ in shards) == int(shards[0][1]) == len(_weights(want))
    got = tmp_path / "ckpt" / "step-00000003"
    error = _relative_error(_weights(got), _weights(want))
    assert error < 1e-10, f"relative error {error:.3g}"
    state, want_state = _optimizer_state(got), _optimizer_state(want)
    assert state.keys() == want_state.keys() and len(state) == len(_weights(want))
    for index, moments in want_state.items():
        assert float(state[index]["step"]) == float(moments["step"]) == 3
        for name in ("exp_avg", "exp_avg_sq"):
            error = _relative_error({name: state[index][name]}, {name: moments[name]})
            assert error < 1e-10, f"{name} of parameter {index}: relative error {error:.3g}"


def test_two_ranks_resume_across_sharded_and_replicated_state_and_reach_the_uninterrupted_parameters(
    tmp_path: Path, tiny: Path
) -> None:
    """Batches of 2 groups, three epochs, each resumed from the previous one's checkpoint: ZeRO-1
    (steps 1-2), replicated optimizer state (steps 3-4), ZeRO-1 again (steps 5-6), so each kind of
    checkpoint is resumed by the other."""
    want = _single_process(tmp_path / "single", per_batch=2, repeat=3)
    first = _torchrun(tmp_path, *_sets(tmp_path, 1, SHARD, per_batch=2))
    assert first.returncode == 0, first.stderr[-3000:]
    for repeat, shard in ((2, ()), (3, (SHARD,))):
        args = (*_sets(tmp_path, repeat, *shard, per_batch=2), "--overwrite", "--resume", str(tmp_path / "ckpt"))
        resumed = _torchrun(tmp_path, *args)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines if r["event"] == "step"] == [2 * repeat - 1, 2 * repeat]
    error = _relative_error(_weights(tmp_path / "ckpt" / "step-00000006"), _weights(want))
    assert error < 1e-10, f"relative error {error:.3g}"


def test_without_an_admission_each_rank_claims_at_most_its_share_of_a_batch(tmp_path: Path, unbounded: Path) -> None:
    """8 groups per batch over 2 ranks and no admission object: each rank has at most 4 groups in
    flight, so neither takes more than 4 of a batch while the other claims (usually 4 each; not
    checked, it depends on timing), and the update is still the single process's. The reward pauses (``slow_even_tokens``) so that a group stays in flight
    longer than the ranks' start may differ, as real rollouts do: a rank that came to a batch alone
    may claim more than its share once its own groups close (the bound is on groups in flight)."""
    want = _single_process(tmp_path / "single", 8, *SLOW_REWARD, repeat=4)
    done = _torchrun(tmp_path, *_sets(tmp_path, 4, *SLOW_REWARD, per_batch=8), "--verbose")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("event='admission bound' max_groups=4") == 2, done.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["event"] == "step"]
    assert [r["in_flight_groups"] <= 4 for r in steps] == [True, True]  # rank 0's admission
    # how the 8 fell between the ranks depends on their timing (the bound is on groups in flight)
    assert [sum(r["groups_per_rank"]) for r in steps] == [8, 8]
    error = _relative_error(_weights(tmp_path / "ckpt" / "step-00000002"), _weights(want))
    assert error < 1e-10, f"relative error {error:.3g}"


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_rank_that_fails_mid_run_ends_every_rank_with_an_error_naming_it(
    tmp_path: Path, tiny: Path, how: str
) -> None:
    """The run ends within the collectives' timeout (10 s here) of the failure plus a margin for a
    loaded machine, counted from the failure (``THUNDERSYNC_TEST_FAIL_MARK``), not the start-up."""
    reward = [
        'objects.scorer.factory="function-reward"',
        'objects.scorer.function="tests.app.rank_rewards:even_tokens"',
    ]
    mark = tmp_path / "failed-at"
    env = {"THUNDERSYNC_TEST_FAIL_RANK": "1", "THUNDERSYNC_TEST_FAIL_HOW": how, "THUNDERSYNC_TEST_FAIL_MARK": str(mark)}
    env["THUNDERSYNC_DIST_TIMEOUT_S"] = "10"
    done = _torchrun(tmp_path, *_sets(tmp_path, 2, *reward, "objects.scorer.text=false"), env=env, timeout=180)
    assert time.monotonic() - float(mark.read_text()) < 10 + 30
    assert done.returncode != 0
    if how == "raise":
        assert "thundersync: rank 1 of 2: run failed (StageFailed)" in done.stderr
        assert "ValueError: reward crashed on rank 1 (test)" in done.stderr
    else:
        # torchrun's own summary names the dead rank, its host and pid (it ends rank 0 at once)
        assert re.search(
            r"host      : \S+\n  rank      : 1 \(local_rank: 1\)\n  exitcode  : -9 \(pid: \d+\)", done.stderr
        )
        assert "Signal 9 (SIGKILL)" in done.stderr
    assert not (tmp_path / "ckpt").exists(), "a failed run writes no final checkpoint"


def test_a_rank_that_hangs_ends_the_run_within_the_timeout_with_one_line_naming_it(tmp_path: Path, tiny: Path) -> None:
    """Rank 1 hangs in an optimizer step (after the gradient reduction: alive, it reports nothing);
    rank 0's next collective or step records' gather ends within THUNDERSYNC_DIST_TIMEOUT_S with a
    line naming rank 1's host and pid (the launcher's), not gloo's own timeout. The time is
    counted from the hang (``THUNDERSYNC_TEST_FAIL_MARK``), not from the start-up."""
    reward = [
        'objects.scorer.factory="function-reward"',
        'objects.scorer.function="tests.app.rank_rewards:even_tokens"',
    ]
    mark = tmp_path / "hangs-from"
    env = {"THUNDERSYNC_TEST_FAIL_RANK": "1", "THUNDERSYNC_TEST_FAIL_HOW": "hang", "THUNDERSYNC_DIST_TIMEOUT_S": "8"}
    env["THUNDERSYNC_TEST_FAIL_MARK"] = str(mark)
    done = _torchrun(tmp_path, *_sets(tmp_path, 2, *reward, "objects.scorer.text=false"), env=env, timeout=180)
    assert time.monotonic() - float(mark.read_text()) < 8 + 30, "within the timeout of the hang, plus a margin"
    assert done.returncode != 0
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("thundersync: rank 0 of 2: run failed")]
    (pid,) = re.findall(r"rank      : 1 \(local_rank: 1\)\n  exitcode  : -15 \(pid: (\d+)\)", done.stderr)
    assert f"rank 1 (host {socket.gethostname()}, pid {pid}, still running) did not reach the " in line, line
    assert (
        "within 8 s and reported no failure: hung, or slower than that; if the ranks are only slow, give them " in line
    )
    assert "THUNDERSYNC_DIST_TIMEOUT_S under `thundersync run`" in line
    assert "timed out" not in line.lower(), "not gloo's own words"


@pytest.mark.gpu
def test_two_cuda_ranks_through_nccl_reach_the_single_process_parameters(tmp_path: Path, tiny: Path) -> None:
    """Each rank on cuda:LOCAL_RANK (``device = "cuda"``), NCCL. fp64 on CUDA reduces in a different
    order than on the CPU, hence 1e-8 rather than the CPU test's 1e-10."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    cuda = 'objects.model.device="cuda"'
    tmp_single = tmp_path / "single"
    tmp_single.mkdir()
    argv = ["run", str(tiny), "--metrics", str(tmp_single / "m.jsonl"), "--no-progress", *_sets(tmp_single, 2, cuda)]
    assert main(argv) == 0
    done = _torchrun(tmp_path, *_sets(tmp_path, 2, cuda))
    assert done.returncode == 0, done.stderr[-3000:]
    want = _weights(tmp_single / "ckpt" / "step-00000003")
    error = _relative_error(_weights(tmp_path / "ckpt" / "step-00000003"), want)
    assert error < 1e-8, f"relative error {error:.3g}"
