"""A sharded learner's checkpoint (``torch.distributed.checkpoint``) resumes exactly, on fewer ranks.

A run of 2 gloo ranks saves after its first step; 1 rank resumes it and steps: after each step
the parameters equal one uninterrupted process's (fp64). (4 -> 2 works the same way; CI runs the
smaller chain.)
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.engine.test_distributed import _batch, _connect, _dumps, _relative_error, _spawn, _stream_group
from tests.engine.test_sharded_distributed import MAX_NORM, _adamw, _grpo_reference, _snapshot
from tests.engine.tiny_models import tiny_qwen3
from thundersync.scheduling import GroupClaims

pytestmark = pytest.mark.slow


def _rank(rank: int, world_size: int, port: int, load: str, save: str, step: int, out: Any) -> None:
    """Resume from ``load`` (unless empty), train ``step`` (GRPO, AdamW, clipped), save to ``save``."""
    import thundersync
    from thundersync.engine.sharded import ShardedDataParallel

    store = _connect(rank, world_size, port)
    torch.set_num_threads(1)
    model = tiny_qwen3(torch.float64, seed=7 if load else 0)  # resumed: every weight must come from the checkpoint
    sharded = ShardedDataParallel(model, store=store, timeout_s=60)
    optimizer = _adamw(sharded.parameters())
    if load:
        sharded.load(load, optimizer)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model, data_parallel=sharded))
    claims = GroupClaims(store, rank=rank, world_size=world_size, prefix="resume", timeout_s=60)
    batch = _batch(step)
    while (index := claims.claim(step, len(batch))) is not None:
        _stream_group(grpo, index, batch[index])
        claims.close(step, index, len(batch))
    claims.wait_sealed(step)
    grpo.assert_safe_to_step()
    sharded.all_reduce_gradients(grpo.run.params)
    sharded.clip_grad_norm(grpo.run.params, MAX_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sharded.stepped()
    sharded.save(save, optimizer)
    out.put((rank, _dumps(_snapshot(grpo.run.params))))
    dist.destroy_process_group()


def test_a_sharded_run_resumes_exactly_on_fewer_ranks(tmp_path: Path) -> None:
    want, _ = _grpo_reference(_adamw, steps=2)
    load = ""
    for step, world_size in enumerate((2, 1)):
        save = str(tmp_path / f"step{step + 1}")
        results, codes, _ = _spawn(_rank, world_size, load, save, step)
        assert codes == [0] * world_size, f"{world_size} ranks, step {step + 1}: exit codes {codes}"
        for rank, blob in results:
            error = _relative_error(torch.load(io.BytesIO(blob)), want[step])
            assert error < 1e-10, f"{world_size} ranks, rank {rank}, after step {step + 1}: relative error {error:.3g}"
        load = save
