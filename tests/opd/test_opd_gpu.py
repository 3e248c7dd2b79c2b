"""OPD on CUDA: the background worker packs queued turns; results equal the dense reference."""

from __future__ import annotations

import random

import pytest
import torch

import thundersync
from tests.opd.opd_cases import (
    collect_grads,
    dense_reference_grads,
    drive,
    interleaving,
    plans,
    relative_error,
    tiny_qwen3,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", range(3))
def test_streamed_gradient_on_cuda_equals_the_dense_reference(seed: int) -> None:
    from hypothesis import find

    def rich(plan) -> bool:  # several trajectories and scored tokens, not the shrunk minimum
        trajectories = [t for g in plan.values() for t in g.trajectories.values()]
        return len(trajectories) >= 3 and sum(sum(turn.scored) for t in trajectories for turn in t.turns) >= 8

    plan = find(plans(with_behaviour=seed % 2 == 1, max_groups=3), rich, random=random.Random(seed))
    model = tiny_qwen3(torch.float32).cuda()
    want = dense_reference_grads(model, plan, "token_mean")
    run = thundersync.StreamingRun(model)
    assert run.worker.background
    opd = thundersync.OPDStream(run)
    for _ in drive(opd, plan, interleaving(plan, random.Random(seed))):
        pass
    opd.assert_safe_to_step()
    assert relative_error(collect_grads(model), want) < 1e-5
