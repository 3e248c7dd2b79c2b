"""``[run] shard = true`` with a checkpointer: a sharded run from a pipeline file saves its
checkpoints in the distributed layout (every rank writes its shards) and ``--resume`` continues
it on the same number of ranks or another one, to the uninterrupted one-process run (fp64, 1e-10).

The file is examples/train_tiny_grpo.toml (fp64, batches of 2 of its 4 prompts, an admission of
one group in flight: ``test_data_parallel.py`` says why), checkpointing every 2 steps with
``consolidated = true``: each checkpoint also holds the whole model as safetensors, gathered on
rank 0, which the tests compare with the unsharded run's own checkpoint of the same step. The
later batches are sampled from the resumed weights, so the steps' gradient norms see any
difference in the restored model, optimizer or schedule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.app.cli.test_data_parallel import ADMISSION, ROOT, _relative_error, _torchrun
from thundersync.app.cli.command import main

pytestmark = pytest.mark.slow

EVERY = ("objects.checkpointer.every=2", "objects.checkpointer.keep_last=3")


def _sets(tmp: Path, repeat: int, *extra: str) -> list[str]:
    items = ['objects.model.dtype="float64"', "stages.source.groups_per_batch=2", f"stages.source.repeat={repeat}"]
    items += [f'objects.checkpointer.directory="{tmp / "ckpt"}"', *EVERY, *extra]
    return [arg for item in items for arg in ("--set", item)]


SHARDED = ("run.shard=true", "objects.checkpointer.consolidated=true")


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text((ROOT / "examples" / "train_tiny_grpo.toml").read_text() + ADMISSION)
    return path


def _in_process(tmp: Path, metrics: Path, repeat: int, *extra: str, resume: bool = False) -> None:
    argv = ["run", str(tmp / "tiny.toml"), "--metrics", str(metrics), "--no-progress", *_sets(tmp, repeat, *extra)]
    assert main(argv + (["--resume", str(tmp / "ckpt")] if resume else [])) == 0


def _reference(tmp: Path, repeat: int) -> Path:
    """The uninterrupted one-process run, unsharded (the files layout): its checkpoint directory."""
    single = tmp / "single"
    single.mkdir()
    (single / "tiny.toml").write_text((tmp / "tiny.toml").read_text())
    _in_process(single, single / "m.jsonl", repeat)
    return single / "ckpt"


def _steps(path: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "step"}


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "model.safetensors")


def _layout(checkpoint: Path) -> tuple[str, list[str]]:
    info = json.loads((checkpoint / "checkpoint.json").read_text())
    return info["layout"], sorted(p.name for p in (checkpoint / "distributed").glob("*.distcp"))


def _equal(got: Path, want: Path, steps: range) -> None:
    """The even ones of ``steps``: the checkpoints' consolidated weights equal the unsharded run's."""
    for step in steps:
        if step % 2 == 0:
            name = f"step-{step:08d}"
            error = _relative_error(_weights(got / "ckpt" / name), _weights(want / name))
            assert error < 1e-10, f"step {step}: relative error {error:.3g}"


def _norms(metrics: Path, single: Path, steps: range) -> None:
    got, want = _steps(metrics), _steps(single.parent / "m.jsonl")
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-10), step
        assert got[step]["tokens"] == want[step]["tokens"], step


def test_a_sharded_run_resumes_from_one_process_on_two_ranks_and_from_two_ranks_in_one(
    tmp_path: Path, tiny: Path
) -> None:
    """Steps 1-2 in one process ([run] shard = true: the distributed layout, one file), 3-4 resumed
    on 2 sharded ranks (1 -> 2: each rank writes its shards), 5-6 resumed in one process (2 -> 1).
    A save on 2 ranks and a load on 2 ranks each run here, so 2 -> 2 has no launch of its own
    (CI's time); the GPU test below resumes 2 NCCL ranks on 2."""
    want = _reference(tmp_path, repeat=3)
    _in_process(tmp_path, tmp_path / "m1.jsonl", 1, *SHARDED)
    assert _layout(tmp_path / "ckpt" / "step-00000002") == ("distributed", ["__0_0.distcp"])
    done = _torchrun(tmp_path, *_sets(tmp_path, 2, *SHARDED), "--resume", str(tmp_path / "ckpt"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert _layout(tmp_path / "ckpt" / "step-00000004") == ("distributed", ["__0_0.distcp", "__1_0.distcp"])
    _norms(tmp_path / "m.jsonl", want, range(3, 5))
    _in_process(tmp_path, tmp_path / "m3.jsonl", 3, *SHARDED, resume=True)
    _norms(tmp_path / "m3.jsonl", want, range(5, 7))
    _equal(tmp_path, want, range(1, 7))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "run.json",
        "step-00000002",
        "step-00000004",
        "step-00000006",
    ], "one run, no temporaries"


@pytest.mark.gpu
def test_two_cuda_sharded_ranks_resume_on_two_ranks(tmp_path: Path, tiny: Path) -> None:
    """The same on cuda:LOCAL_RANK through NCCL (the broadcast of the temporary's name, DCP's
    collectives, the consolidated gather); fp64 on CUDA reduces in another order: 1e-8."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    cuda = 'objects.model.device="cuda"'
    single = tmp_path / "single"
    single.mkdir()
    (single / "tiny.toml").write_text(tiny.read_text())
    _in_process(single, single / "m.jsonl", 2, cuda)
    first = _torchrun(tmp_path, *_sets(tmp_path, 1, cuda, *SHARDED))
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _torchrun(tmp_path, *_sets(tmp_path, 2, cuda, *SHARDED), "--resume", str(tmp_path / "ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name in ("step-00000002", "step-00000004"):
        error = _relative_error(_weights(tmp_path / "ckpt" / name), _weights(single / "ckpt" / name))
        assert error < 1e-8, f"{name}: relative error {error:.3g}"
