"""A sharded learner (FSDP2): gloo ranks that claim groups at run time reach the single-process update.

Each test spawns real processes that join one gloo group through a TCPStore served by the test
process (``tests/engine/test_distributed.py``'s helpers). One spawn per world size trains GRPO and
OPD for two steps each (clipping active) and the planted errors; the test process computes the
single-process reference.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.engine.test_distributed import (
    _batch,
    _connect,
    _dumps,
    _opd_batch,
    _relative_error,
    _spawn,
    _stream_group,
    _stream_opd_group,
)
from tests.engine.tiny_models import tiny_qwen3
from thundersync.scheduling import GroupClaims

pytestmark = pytest.mark.slow

STEPS = 2
MAX_NORM = 0.05  # below the batches' gradient norms: clipping is active in every step


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, maximize=True)


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _snapshot(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _grpo_reference(make: Any = _sgd, steps: int = STEPS) -> tuple[list[list[torch.Tensor]], list[float]]:
    """One process: GRPO, SGD with momentum (or ``make``'s optimizer), the norm clipped; the
    parameters after each step."""
    import thundersync

    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(tiny_qwen3(torch.float64)))
    optimizer = make(grpo.run.params)
    snapshots, norms = [], []
    for step in range(steps):
        for index, group in enumerate(_batch(step)):
            _stream_group(grpo, index, group)
        grpo.assert_safe_to_step()
        norms.append(float(torch.nn.utils.clip_grad_norm_(grpo.run.params, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        snapshots.append(_snapshot(grpo.run.params))
    return snapshots, norms


def _grpo_rank(store: Any, rank: int, world_size: int, plant: str) -> tuple[list[list[torch.Tensor]], list[float]]:
    """The same through a ShardedDataParallel, each rank streaming the groups it claims;
    ``plant``: an error planted in the reduction ("", "twice": reduced twice, "skip": rank 1's
    shards get no gradient)."""
    import thundersync
    from thundersync.engine.sharded import ShardedDataParallel

    model = tiny_qwen3(torch.float64, seed=rank)  # different weights: the broadcast makes them rank 0's
    sharded = _Planted(model, store=store, timeout_s=60, plant=plant)
    optimizer = _sgd(sharded.parameters())
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model, data_parallel=sharded))
    claims = GroupClaims(store, rank=rank, world_size=world_size, prefix=f"sharded/grpo/{plant}", timeout_s=60)
    snapshots, norms = [], []
    addresses = [p.data_ptr() for p in grpo.run.params]
    for step in range(STEPS):
        batch = _batch(step)
        while (index := claims.claim(step, len(batch))) is not None:
            _stream_group(grpo, index, batch[index])
            claims.close(step, index, len(batch))
        claims.wait_sealed(step)
        grpo.assert_safe_to_step()
        sharded.all_reduce_gradients(grpo.run.params)
        norms.append(sharded.clip_grad_norm(grpo.run.params, MAX_NORM))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sharded.stepped()
        snapshots.append(_snapshot(grpo.run.params))
        claims.finish(step)
    assert isinstance(sharded, ShardedDataParallel)
    assert [p.data_ptr() for p in grpo.run.params] == addresses, "the gathered parameters stay where they are"
    return snapshots, norms


class _Planted:
    """A ShardedDataParallel with an error planted in its reduction (made lazily: spawn pickles)."""

    def __new__(cls, model: torch.nn.Module, *, plant: str, **options: Any) -> Any:
        from thundersync.engine.sharded import ShardedDataParallel

        class Planted(ShardedDataParallel):
            def all_reduce_gradients(self, params: Any) -> None:
                if plant == "twice":
                    for p in params:  # the sum reduced, then reduced again
                        p.grad = p.grad * self.world_size if p.grad is not None else None
                super().all_reduce_gradients(params)
                if plant == "skip" and self.rank == 1:
                    for p in self.parameters():
                        p.grad = None

        return Planted(model, **options)


def _opd_train(data_parallel: Any = None, claims: Any = None) -> tuple[list[list[torch.Tensor]], list[float]]:
    """OPD (token_mean) through StreamingTrainer with AdamW and clipping; with ``claims``, only the
    groups this rank claims. The parameters after each step."""
    import anyio

    import thundersync
    from thundersync.events import BatchReady

    model = tiny_qwen3(torch.float64) if data_parallel is None else data_parallel.model
    run = thundersync.StreamingRun(model, data_parallel=data_parallel)
    opd = thundersync.OPDStream(run)
    params = run.params if data_parallel is None else data_parallel.parameters()
    trainer = thundersync.StreamingTrainer(opd, _adamw(params), max_grad_norm=MAX_NORM)
    snapshots, norms = [], []
    for step in range(STEPS):
        batch = _opd_batch(step)
        if claims is None:
            for index, group in enumerate(batch):
                _stream_opd_group(opd, index, group)
        else:
            while (index := claims.claim(step, len(batch))) is not None:
                _stream_opd_group(opd, index, batch[index])
                claims.close(step, index, len(batch))
            claims.wait_sealed(step)
        result = anyio.run(trainer.step, BatchReady(batch_id=step, num_groups=len(batch)))
        norms.append(result.grad_norm)
        snapshots.append(_snapshot(run.params))
        if claims is not None:
            claims.finish(step)
    return snapshots, norms


def _rank(rank: int, world_size: int, port: int, out: Any) -> None:
    from thundersync.engine.sharded import ShardedDataParallel, rank_bytes
    from thundersync.errors import ConfigError

    store = _connect(rank, world_size, port)
    torch.set_num_threads(1)
    results: dict[str, Any] = {plant: _grpo_rank(store, rank, world_size, plant) for plant in ("", "twice", "skip")}
    sharded = ShardedDataParallel(tiny_qwen3(torch.float64, seed=rank), store=store, timeout_s=60)
    claims = GroupClaims(store, rank=rank, world_size=world_size, prefix="sharded/opd", timeout_s=60)
    results["opd"] = _opd_train(sharded, claims)
    optimizer = _adamw(sharded.parameters())
    for p in sharded.parameters():  # one step with any gradient: AdamW's state exists
        p.grad = torch.zeros_like(p)
    optimizer.step()
    results["bytes"] = rank_bytes(sharded.parameters(), optimizer)
    try:  # a parameter the sharded model does not have (a run made over another model)
        sharded.all_reduce_gradients([torch.nn.Parameter(torch.zeros(3, 2))])
    except ConfigError as error:
        results["foreign"] = str(error)
    out.put((rank, _dumps(results)))
    dist.destroy_process_group()


def _check(name: str, got: tuple[list[list[torch.Tensor]], list[float]], want: Any, rank: int) -> None:
    for step in range(STEPS):
        error = _relative_error(got[0][step], want[0][step])
        assert error < 1e-10, f"{name}, rank {rank}, after step {step + 1}: relative error {error:.3g}"
        assert abs(got[1][step] - want[1][step]) <= 1e-10 * want[1][step], f"{name}: norms {got[1]} vs {want[1]}"
        assert want[1][step] > MAX_NORM, "clipping is active"


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_ranks_equal_one_process_for_grpo_and_opd_and_catch_planted_errors(world_size: int) -> None:
    results, codes, _ = _spawn(_rank, world_size)
    assert codes == [0] * world_size, f"rank exit codes {codes}"
    by_rank = {rank: torch.load(io.BytesIO(blob), weights_only=False) for rank, blob in results}
    grpo, opd = _grpo_reference(), _opd_train()
    for rank, trained in by_rank.items():
        _check("grpo", trained[""], grpo, rank)
        _check("opd", trained["opd"], opd, rank)
        for plant in ("twice", "skip"):  # the same check catches either error
            with pytest.raises(AssertionError, match="relative error|norms"):
                _check(plant, trained[plant], grpo, rank)
    assert by_rank[0]["foreign"] == (
        "a parameter of shape (3, 2) is not one of the sharded model's gathered parameters; make the "
        "StreamingRun after the ShardedDataParallel, over the same model"
    )
    whole = sum(p.numel() * p.element_size() for p in tiny_qwen3(torch.float64).parameters())
    for rank, trained in by_rank.items():
        held = trained["bytes"]
        assert held.parameters <= 1.3 * whole / world_size, f"rank {rank}: {held} of {whole}"
        assert held.optimizer <= 2 * 1.3 * whole / world_size, f"rank {rank}: AdamW's two moments, {held}"
    assert sum(t["bytes"].parameters for t in by_rank.values()) == whole, "the shards hold every parameter once"


def _lora_train(sharded_model: Any = None, store: Any = None, rank: int = 0, world_size: int = 1) -> Any:
    """GRPO on a LoRA adapter over the tiny model (AdamW, clipping): one process, or one rank of a
    sharded learner (the frozen base sharded too). Every parameter after each step."""
    import anyio

    import thundersync
    from tests.engine.tiny_models import with_lora
    from thundersync.engine.sharded import ShardedDataParallel, rank_bytes
    from thundersync.events import BatchReady

    model = with_lora(tiny_qwen3(torch.float64, seed=rank))
    sharded = None if store is None else ShardedDataParallel(model, store=store, timeout_s=60)
    run = thundersync.StreamingRun(model, data_parallel=sharded)
    grpo = thundersync.RewardLinearBackward(run)
    optimizer = _adamw(run.params if sharded is None else sharded.parameters())
    trainer = thundersync.StreamingTrainer(grpo, optimizer, max_grad_norm=MAX_NORM)
    claims = None if store is None else GroupClaims(store, rank=rank, world_size=world_size, prefix="lora")
    snapshots, norms = [], []
    for step in range(STEPS):
        batch = _batch(step)
        for index in _indices(claims, step, len(batch)):
            _stream_group(grpo, index, batch[index])
        norms.append(anyio.run(trainer.step, BatchReady(batch_id=step, num_groups=len(batch))).grad_norm)
        snapshots.append(_snapshot(list(model.parameters())))  # the base too: it must not move
        if claims is not None:
            claims.finish(step)
    held = None if sharded is None else rank_bytes(list(sharded.sharded.values()), optimizer)
    return (snapshots, norms), held, len(run.params)


def _indices(claims: GroupClaims | None, step: int, groups: int) -> Any:
    """Every group of the batch, or (with ``claims``) the ones this rank claims, each closed after
    the caller streamed it; the batch sealed at the end."""
    if claims is None:
        yield from range(groups)
        return
    while (index := claims.claim(step, groups)) is not None:
        yield index
        claims.close(step, index, groups)
    claims.wait_sealed(step)


def _lora_rank(rank: int, world_size: int, port: int, out: Any) -> None:
    store = _connect(rank, world_size, port)
    torch.set_num_threads(1)
    out.put((rank, _dumps(_lora_train(store=store, rank=rank, world_size=world_size))))
    dist.destroy_process_group()


def test_a_lora_adapter_over_a_sharded_frozen_base_equals_one_process() -> None:
    results, codes, _ = _spawn(_lora_rank, 2)
    assert codes == [0, 0], f"rank exit codes {codes}"
    want, _, adapters = _lora_train()
    base = sum(p.numel() * p.element_size() for p in tiny_qwen3(torch.float64).parameters())
    for rank, blob in results:
        got, held, trained = torch.load(io.BytesIO(blob), weights_only=False)
        assert trained == adapters and adapters < 30, "only the adapter is trained"
        _check("lora", got, want, rank)
        assert held.parameters < 0.6 * base and held.gradients < 0.2 * held.parameters, held


def _hanging_rank(rank: int, world_size: int, port: int, out: Any) -> None:
    """Rank 1 hangs (alive, no failure) instead of reducing; rank 0's reduce-scatter must name it.
    Rank 0 first offers an already sharded model, which is refused (no collective is entered)."""
    import datetime
    import os

    from thundersync.engine.sharded import ShardedDataParallel
    from thundersync.errors import ConfigError, DistributedError

    store = _connect(rank, world_size, port)
    model = tiny_qwen3(torch.float64)
    sharded = ShardedDataParallel(model, store=store, timeout_s=3)
    if rank == 1:
        out.put((rank, "pid", str(os.getpid())))
        store.wait(["test/rank0-done"], datetime.timedelta(seconds=60))  # hangs past rank 0's timeout
        dist.destroy_process_group()
        return
    said: dict[str, str] = {}
    try:
        ShardedDataParallel(model, store=store)
    except ConfigError as error:
        said["refused"] = str(error)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    try:
        sharded.all_reduce_gradients(list(model.parameters()))
    except DistributedError as error:
        said["error"] = str(error)
    out.put((rank, "said", said))  # one message per rank: the spawn waits for as many
    store.set("test/rank0-done", b"1")
    dist.destroy_process_group()


def test_a_rank_that_hangs_ends_the_sharded_reduction_within_the_timeout_with_a_line_naming_it() -> None:
    import socket

    results, _, _ = _spawn(_hanging_rank, 2)
    said = next(text for _, what, text in results if what == "said")
    said["pid"] = next(text for _, what, text in results if what == "pid")
    assert said["refused"].startswith("the FSDPQwen3ForCausalLM is sharded already (fully_shard); give ")
    assert said["error"].startswith(
        f"rank 0 of 2: rank 1 (host {socket.gethostname()}, pid {said['pid']}, still running) did not reach "
        "the gradient reduce-scatter ("
    ), said["error"]
    assert "within 3 s and reported no failure: hung, or slower than that" in said["error"]
