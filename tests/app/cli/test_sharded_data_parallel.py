"""``torchrun -m thundersync run FILE --set run.shard=true``: two gloo ranks of a sharded learner
(FSDP2) reach the single-process run: every step's gradient norm, rewards and tokens (the later
batches are sampled from the updated weights, so they see any difference in the parameters).

The file is examples/train_tiny_grpo.toml without its checkpointer (the steps' records are what
is compared; a sharded run's checkpoints are tested in ``test_sharded_checkpoints.py``), with an
admission of one group in flight (``test_data_parallel.py`` says why).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.app.cli.test_data_parallel import ADMISSION, ROOT, _torchrun
from thundersync.app.cli.command import main

pytestmark = pytest.mark.slow


def _without_checkpointer(text: str) -> str:
    start, stop = text.index("[objects.checkpointer]"), text.index("[stages.source]")
    return text[:start] + text[stop:]


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(_without_checkpointer((ROOT / "examples" / "train_tiny_grpo.toml").read_text()) + ADMISSION)
    return path


def _steps(path: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "step"]


def _plain(tmp: Path, *extra: str) -> list[str]:
    items = ['objects.model.dtype="float64"', "stages.source.groups_per_batch=3", "stages.source.repeat=2", *extra]
    return [arg for item in items for arg in ("--set", item)]


def test_two_sharded_ranks_from_the_command_line_reach_the_single_process_steps(tmp_path: Path, tiny: Path) -> None:
    single = tmp_path / "single"
    single.mkdir()
    argv = ["run", str(tiny), "--metrics", str(single / "m.jsonl"), "--no-progress", *_plain(single)]
    assert main(argv) == 0
    done = _torchrun(tmp_path, *_plain(tmp_path, "run.shard=true"), "--verbose")
    assert done.returncode == 0, done.stderr[-3000:]
    held = re.findall(r"event='run sharded' parameter_bytes='(\d+) of (\d+)' rank=(\d)", done.stderr)
    assert len(held) == 2 and sum(int(mine) for mine, _, _ in held) == int(held[0][1]), done.stderr[-3000:]
    want, got = _steps(single / "m.jsonl"), _steps(tmp_path / "m.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-10)
    for key in ("tokens", "reward_mean", "reward_std"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-12), key
    assert sum(r["groups_per_rank"][1] for r in got) > 0, "rank 1 took no group"


@pytest.mark.parametrize("refused", ["shard_state", "audit_every"])
def test_the_factories_refuse_what_a_sharded_run_does_not_support(refused: str) -> None:
    """The optimizer's ZeRO-1 and the trainer's audit on a run whose data parallel is sharded
    (in this process: the refusals read only the run's data-parallel object)."""
    import torch

    from thundersync.app.factories import training
    from thundersync.engine.sharded import ShardedDataParallel
    from thundersync.errors import ConfigError

    param = torch.nn.Parameter(torch.zeros(2))
    run = SimpleNamespace(data_parallel=object.__new__(ShardedDataParallel), params=[param])
    objective: Any = SimpleNamespace(run=run, signal=None)
    if refused == "shard_state":
        with pytest.raises(ConfigError, match="shard_state = true shards the optimizer's state with ZeRO-1"):
            training.optimizer(objective=objective, name="SGD", shard_state=True, lr=0.1)
    else:
        optimizer = torch.optim.SGD([param], lr=0.1)
        with pytest.raises(ConfigError, match="audit_every = 1: the audit recomputes the gradient through the model's"):
            training.trainer(objective=objective, optimizer=optimizer, audit_every=1)


@pytest.mark.gpu
def test_two_cuda_sharded_ranks_through_nccl_reach_the_single_process_steps(tmp_path: Path, tiny: Path) -> None:
    """Each rank on cuda:LOCAL_RANK, NCCL, the engine's CUDA graphs on (the gathered weights keep
    their addresses). fp64 on CUDA reduces in another order than on the CPU: 1e-8."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    cuda = 'objects.model.device="cuda"'
    single = tmp_path / "single"
    single.mkdir()
    assert main(["run", str(tiny), "--metrics", str(single / "m.jsonl"), "--no-progress", *_plain(single, cuda)]) == 0
    done = _torchrun(tmp_path, *_plain(tmp_path, cuda, "run.shard=true"))
    assert done.returncode == 0, done.stderr[-3000:]
    want, got = _steps(single / "m.jsonl"), _steps(tmp_path / "m.jsonl")
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-8)
    for key in ("tokens", "reward_mean"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-8), key
