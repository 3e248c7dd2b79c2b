"""The checkpointer's distributed layout (``distributed = true``, what ``[run] shard = true`` gives
it), in one process: it saves and resumes the model, the optimizer and the schedule exactly, and
it reads nothing it has not checked (links, unexpected pickled globals, file names outside its
directory, missing shards are refused with the checkpoint named). The sharded, several-rank
runs are in tests/app/cli/test_sharded_checkpoints.py.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.tiny_models import tiny_qwen3, with_lora
from thundersync.app.checkpoints._distributed import require_shards
from thundersync.app.checkpoints.checkpoint import Checkpointer
from thundersync.errors import ConfigError
from thundersync.pipeline.policy import PolicyClock


def _trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A tiny fp64 Qwen3, AdamW and a schedule after ``steps`` steps on random gradients."""
    model = tiny_qwen3(torch.float64, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, maximize=True)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=4)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
        optimizer.step()
        schedule.step()
    return model, optimizer, schedule


def _checkpointer(
    directory: Path, trained: tuple[torch.nn.Module, torch.optim.Optimizer, Any], **options: Any
) -> Checkpointer:
    model, optimizer, schedule = trained
    policy = PolicyClock()
    return Checkpointer(directory, model=model, optimizer=optimizer, policy=policy, scheduler=schedule, **options)


def _saved(tmp_path: Path, **options: Any) -> Path:
    return _checkpointer(tmp_path / "ckpt", _trained(0, 2), distributed=True, **options).save_distributed(2)


def test_the_distributed_layout_resumes_the_model_optimizer_and_schedule_bitwise(tmp_path: Path) -> None:
    saved = _trained(0, 2)
    temporary = tmp_path / "ckpt" / ".step-00000001.left.tmp"  # a killed writer's
    temporary.mkdir(parents=True)
    path = _checkpointer(tmp_path / "ckpt", saved, distributed=True).save_distributed(2)
    assert not temporary.exists(), "temporaries are cleaned at a save"
    info = json.loads((path / "checkpoint.json").read_text())
    assert (info["layout"], info["step"], info["weights"]) == ("distributed", 2, "full")
    assert sorted(os.listdir(path / "distributed")) == [".metadata", "__0_0.distcp"]
    assert not list(path.glob("*.safetensors")), "not consolidated: the weights are in distributed/ alone"
    fresh = _trained(7, 0)
    resumed = _checkpointer(tmp_path / "elsewhere", fresh, distributed=True)
    assert resumed.resume(tmp_path / "ckpt") == path and resumed.policy.version == 2
    for (name, want), got in zip(saved[0].state_dict().items(), fresh[0].state_dict().values()):
        assert torch.equal(got, want), name
    want_state, got_state = saved[1].state_dict(), fresh[1].state_dict()
    assert got_state["param_groups"] == want_state["param_groups"]
    for index, moments in want_state["state"].items():
        for key, value in moments.items():
            assert torch.equal(got_state["state"][index][key], value), (index, key)
    assert fresh[2].state_dict() == saved[2].state_dict()


def test_a_consolidated_checkpoint_holds_the_whole_model_as_the_files_layout_does(tmp_path: Path) -> None:
    path = _saved(tmp_path, consolidated=True)
    weights = load_file(path / "model.safetensors")
    want = _trained(0, 2)[0].state_dict()
    assert weights.keys() == want.keys()
    assert all(torch.equal(weights[name], want[name]) for name in want)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


def test_a_file_of_the_distributed_state_that_is_a_link_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    shard = path / "distributed" / "__0_0.distcp"
    os.replace(shard, tmp_path / "moved.distcp")
    shard.symlink_to(tmp_path / "moved.distcp")
    with pytest.raises(
        ConfigError, match=r"the checkpoint .*step-00000002: cannot read .*__0_0.distcp: it is a symbolic link"
    ):
        _checkpointer(tmp_path / "other", _trained(7, 0), distributed=True).resume(path)


def test_a_distributed_directory_that_is_a_link_or_missing_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    os.replace(path / "distributed", tmp_path / "moved")
    with pytest.raises(
        ConfigError, match="records the distributed layout but has no distributed/ directory; it is incomplete"
    ):
        _checkpointer(tmp_path / "other", _trained(7, 0), distributed=True).resume(path)
    (path / "distributed").symlink_to(tmp_path / "moved")
    with pytest.raises(ConfigError, match="distributed is not a directory \\(a link\\?\\); it is damaged"):
        _checkpointer(tmp_path / "other", _trained(7, 0), distributed=True).resume(path)


class _Planted:
    """Unpickled, it would call os.getpid: the metadata's reader must refuse the global."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getpid, ())


def test_metadata_naming_a_global_dcp_never_writes_is_refused_without_running_it(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    (path / "distributed" / ".metadata").write_bytes(pickle.dumps(_Planted()))
    with pytest.raises(
        ConfigError, match=r"distributed/.metadata names posix.getpid, which DCP's metadata never holds"
    ):
        _checkpointer(tmp_path / "other", _trained(7, 0), distributed=True).resume(path)


def test_metadata_naming_a_file_outside_its_directory_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    metadata_path = path / "distributed" / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../../outside.distcp"
    metadata_path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ConfigError, match=r"names the file '../../../outside.distcp', not a file of its directory"):
        _checkpointer(tmp_path / "other", _trained(7, 0), distributed=True).resume(path)


def test_a_shard_missing_on_the_writer_is_refused_before_the_checkpoint_is_marked(tmp_path: Path) -> None:
    """What the writer checks after every rank wrote (ranks that do not share the directory)."""
    path = _saved(tmp_path)
    (path / "distributed" / "__0_0.distcp").unlink()
    with pytest.raises(ConfigError, match="lacks __0_0.distcp, which other ranks wrote: every rank writes its shards"):
        require_shards(path / "distributed")


def test_a_checkpoint_of_the_files_layout_is_refused_by_a_sharded_run(tmp_path: Path) -> None:
    model, optimizer, schedule = _trained(0, 1)
    model.save_pretrained = lambda directory, **options: torch.save({}, Path(directory) / "x.pt")  # type: ignore[method-assign]
    files = _checkpointer(tmp_path / "ckpt", (model, optimizer, schedule))
    path = files.save(1)
    sharded = _checkpointer(tmp_path / "other", _trained(7, 0), distributed=True)
    sharded.sharded = SimpleNamespace(model=sharded.model)  # type: ignore[assignment]  # only its presence is read
    with pytest.raises(
        ConfigError, match="holds the whole model and optimizer \\(the files layout of a run that was not sharded\\)"
    ):
        sharded.resume(path)


def test_a_sharded_model_refuses_a_checkpointer_of_the_files_layout() -> None:
    """``thundersync run`` gives a sharded model's checkpointers its ShardedDataParallel; one that
    would write the files layout (``shard = false`` in its table) is refused."""
    from thundersync.app.cli.distributed import _shard_checkpointers

    trained = _trained(0, 0)
    files, layout = _checkpointer(Path("unused"), trained), _checkpointer(Path("unused"), trained, distributed=True)
    sharded = SimpleNamespace(model=trained[0])
    _shard_checkpointers({"checkpointer": layout}, sharded)
    assert layout.sharded is sharded
    with pytest.raises(ConfigError, match="objects.files: a checkpointer of the files layout saves the whole model"):
        _shard_checkpointers({"files": files}, sharded)


def test_a_lora_adapter_resumes_from_the_distributed_layout_and_consolidates_to_the_adapter_alone(
    tmp_path: Path,
) -> None:
    def adapter(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        model = with_lora(tiny_qwen3(torch.float64, seed=0), seed=seed)  # the frozen base is the same
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for p in optimizer.param_groups[0]["params"]:
            p.grad = torch.full_like(p, 0.5)
        optimizer.step()
        return model, optimizer, None

    saved = adapter(1)
    path = _checkpointer(tmp_path / "ckpt", saved, distributed=True, consolidated=True).save_distributed(1)
    assert json.loads((path / "checkpoint.json").read_text())["weights"] == "adapter"
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["adapter_model.safetensors"]
    fresh = adapter(5)
    _checkpointer(tmp_path / "other", fresh, distributed=True).resume(path)
    for (name, want), got in zip(saved[0].state_dict().items(), fresh[0].state_dict().values()):
        assert torch.equal(got, want), name
    want_state, got_state = saved[1].state_dict()["state"], fresh[1].state_dict()["state"]
    assert all(torch.equal(got_state[i]["exp_avg_sq"], want_state[i]["exp_avg_sq"]) for i in want_state)


def test_a_replica_that_is_not_the_writer_writes_nothing_in_the_distributed_layout(tmp_path: Path) -> None:
    """Replicas (not sharded) hold the same state: the writer alone saves it, as in the files layout."""
    checkpointer = _checkpointer(tmp_path / "ckpt", _trained(0, 1), distributed=True, writer=False)
    checkpointer.save_distributed(1)
    assert not (tmp_path / "ckpt").exists() and checkpointer.saved_step == 1


def test_the_distributed_layout_keeps_the_directory_to_its_run(tmp_path: Path) -> None:
    _saved(tmp_path)
    with pytest.raises(ConfigError, match="holds checkpoints of another run \\(steps 2\\)"):
        _checkpointer(tmp_path / "ckpt", _trained(0, 1), distributed=True).save_distributed(3)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["run.json", "step-00000002"]


def test_a_sharded_model_needs_the_distributed_layout() -> None:
    trained = _trained(0, 0)
    with pytest.raises(ConfigError, match="a sharded model's checkpointer needs distributed=True"):
        _checkpointer(Path("unused"), trained, sharded=SimpleNamespace(model=trained[0]))
