"""Data-parallel streaming: gloo ranks that claim groups at run time reach the single-process update.

Each test starts real processes (from a fork server) that join one gloo group through a TCPStore served by
the test process, so a rank's death never takes the store with it.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import random
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.engine.tiny_models import tiny_qwen3
from thundersync.scheduling import GroupClaims

pytestmark = pytest.mark.slow

VOCAB = 97
STEPS = 2


def _batch(step: int, groups: int = 5) -> list[dict[str, Any]]:
    """Random groups: a prompt, 2-4 trajectories of 1-2 turns (action, observation, action)."""
    rng = random.Random(100 + step)
    out = []
    for _ in range(groups):
        trajectories = []
        for _ in range(rng.randint(2, 4)):
            turns = []
            for k in range(rng.randint(1, 2)):
                if k:
                    turns.append(([rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))], False))
                turns.append(([rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))], True))
            trajectories.append((turns, rng.choice([0.0, 0.5, 1.0])))
        out.append({"prompt": [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))], "trajectories": trajectories})
    return out


def _stream_group(grpo: Any, index: int, group: dict[str, Any]) -> None:
    grpo.open_group(index, group["prompt"])
    for t, (turns, reward) in enumerate(group["trajectories"]):
        for tokens, action in turns:
            grpo.append_turn(index, t, tokens, [action] * len(tokens))
        grpo.close_trajectory(index, t, reward)
    grpo.close_group(index)


def _grpo(model: torch.nn.Module, estimator: str) -> Any:
    import thundersync

    return thundersync.RewardLinearBackward(thundersync.StreamingRun(model), estimator=estimator)


def _optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, maximize=True)


def _single_process(estimator: str) -> list[torch.Tensor]:
    model = tiny_qwen3(torch.float64)
    grpo = _grpo(model, estimator)
    optimizer = _optimizer(grpo.run.params)
    for step in range(STEPS):
        for index, group in enumerate(_batch(step)):
            _stream_group(grpo, index, group)
        grpo.assert_safe_to_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in grpo.run.params]


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _connect(rank: int, world_size: int, port: int) -> Any:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return store


ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _grpo_rank(rank: int, world_size: int, port: int, out: Any) -> None:
    store = _connect(rank, world_size, port)
    torch.set_num_threads(1)
    results = {estimator: _train_rank(store, rank, world_size, estimator) for estimator in ESTIMATORS}
    out.put((rank, _dumps(results)))
    dist.destroy_process_group()


def _train_rank(
    store: Any, rank: int, world_size: int, estimator: str
) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    from thundersync.engine.distributed import DataParallel

    model = tiny_qwen3(torch.float64)
    grpo = _grpo(model, estimator)
    optimizer = _optimizer(grpo.run.params)
    dp = DataParallel(store=store, timeout_s=60)
    claims = GroupClaims(store, rank=rank, world_size=world_size, prefix=f"claims/{estimator}", timeout_s=60)
    rng = random.Random(rank)
    taken = []
    for step in range(STEPS):
        batch = _batch(step)
        while (index := claims.claim(step, len(batch))) is not None:
            time.sleep(rng.uniform(0, 0.02))  # uneven ranks: claims are decided at run time
            _stream_group(grpo, index, batch[index])
            taken.append((step, index))
            claims.close(step, index, len(batch))
        claims.wait_sealed(step)
        grpo.assert_safe_to_step()
        dp.all_reduce_gradients(grpo.run.params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        claims.finish(step)
    return taken, [p.detach() for p in grpo.run.params]


# What the fork server imports once for every rank it starts (torch, transformers' Qwen3, the
# engine); a module a rank needs beyond these it imports itself after the fork.
PRELOAD = (
    "tests.engine.tiny_models",
    "transformers.models.qwen3.modeling_qwen3",
    "thundersync.engine.distributed",
    "thundersync.engine.sharded",
    "thundersync.grpo",
    "thundersync.opd",
)


def _spawn(
    target: Any, world_size: int, *args: Any, preload: Sequence[str] = PRELOAD, expect: int | None = None
) -> tuple[list[Any], list[int | None], Any]:
    """Run ``target(rank, world_size, port, *args, out)`` in ``world_size`` new processes and
    collect ``expect`` results from ``out`` (default: one a rank). The processes come from a fork
    server (``forkserver``: one per test process, started by the first call) that imported
    ``preload`` once, instead of each importing torch and transformers (``spawn``); only the
    first call's ``preload`` counts."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world_size, store.port, *args, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + 120
    while len(results) < (world_size if expect is None else expect) and time.monotonic() < deadline:
        try:
            results.append(out.get(timeout=1))
        except Exception:
            if all(p.exitcode is not None for p in procs) and out.empty():
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return results, [p.exitcode for p in procs], store


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((g - w).pow(2).sum()) for g, w in zip(got, want)) ** 0.5
    den = sum(float(w.pow(2).sum()) for w in want) ** 0.5
    return num / den


@pytest.mark.parametrize("world_size", [3])  # uneven claims; 2 ranks: tests/app/cli/test_data_parallel.py
def test_grpo_ranks_reach_the_single_process_parameters(world_size: int) -> None:
    """Every estimator, two optimizer steps, claims decided at run time (uneven across ranks)."""
    results, codes, _ = _spawn(_grpo_rank, world_size)
    assert codes == [0] * world_size, f"rank exit codes {codes}"
    by_rank = {rank: torch.load(io.BytesIO(blob)) for rank, blob in results}
    for estimator in ESTIMATORS:
        want = _single_process(estimator)
        claimed = sorted(item for rank in by_rank for item in by_rank[rank][estimator][0])
        assert claimed == [(s, i) for s in range(STEPS) for i in range(5)], f"{estimator}: every group exactly once"
        for rank, trained in by_rank.items():
            error = _relative_error(trained[estimator][1], want)
            assert error < 1e-10, f"{estimator}, rank {rank}: relative error {error:.3g}"


def _zero_rank(rank: int, world_size: int, port: int, out: Any) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    _connect(rank, world_size, port)
    plain, sharded = tiny_qwen3(torch.float64), tiny_qwen3(torch.float64)
    full = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    zero = ZeroRedundancyOptimizer(
        list(sharded.parameters()), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1
    )
    for step in range(3):
        generator = torch.Generator().manual_seed(step)  # the same (already reduced) gradient on every rank
        for p, q in zip(plain.parameters(), sharded.parameters()):
            p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            q.grad = p.grad.clone()
        full.step()
        zero.step()
    error = _relative_error([q.detach() for q in sharded.parameters()], [p.detach() for p in plain.parameters()])
    state = sum(t.numel() for s in zero.optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    total = sum(t.numel() for s in full.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    out.put((rank, error, state, total))
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [3])  # uneven claims; 2 ranks: tests/app/cli/test_data_parallel.py
def test_zero1_adamw_equals_unsharded_adamw_and_holds_a_share_of_the_state(world_size: int) -> None:
    results, codes, _ = _spawn(_zero_rank, world_size)
    assert codes == [0] * world_size
    states = []
    total = results[0][3]
    for rank, error, state, _ in results:
        assert error < 1e-12, f"rank {rank}: relative error {error:.3g}"
        states.append(state)
    assert sum(states) == total, "the shards together hold exactly the unsharded state"
    assert max(states) <= 1.25 * total / world_size, f"per-rank state {states} of {total}"


def _failing_rank(rank: int, world_size: int, port: int, how: str, out: Any) -> None:
    """Rank 1 dies (killed) or fails (raises) mid-batch; rank 0 must end with a clear error."""
    from thundersync.engine.distributed import DataParallel
    from thundersync.errors import DistributedError

    store = _connect(rank, world_size, port)
    dp = DataParallel(store=store, timeout_s=5)
    claims = GroupClaims(store, rank=rank, world_size=world_size, timeout_s=5)
    model = tiny_qwen3(torch.float64)
    grpo = _grpo(model, "grpo")
    batch = _batch(0)
    if rank == 0:  # rank 1 must hold a group before rank 0 can take them all (start-up times differ)
        store.wait(["test/rank1-claimed"])
    started = time.monotonic()  # rank 0: about when rank 1 failed, whatever the start-up took
    try:
        while (index := claims.claim(0, len(batch))) is not None:
            if rank == 1:
                store.set("test/rank1-claimed", b"1")
                if how == "killed":
                    import os

                    os._exit(7)
                raise ValueError(f"reward function crashed on group {index}")
            _stream_group(grpo, index, batch[index])
            claims.close(0, index, len(batch))
        claims.wait_sealed(0)
        grpo.assert_safe_to_step()
        dp.all_reduce_gradients(grpo.run.params)
        out.put((rank, "finished", ""))
    except DistributedError as error:
        out.put((rank, "error", f"{error} [after {time.monotonic() - started:.1f} s]"))
    except ValueError as error:
        dp.report_failure(error)
        out.put((rank, "raised", str(error)))


@pytest.mark.parametrize("how", ["killed", "raised"])
def test_a_failed_rank_ends_the_others_with_a_message_naming_it(how: str) -> None:
    """Rank 0 ends within the claims' timeout (5 s) of rank 1's failure, plus a margin for the
    groups it still streams on a loaded machine; the time is counted from the failure, not from
    the processes' start-up (which load slows down; the spawn gives up after 120 s)."""
    results, codes, _ = _spawn(_failing_rank, 2, how)
    survivor = next((r for r in results if r[0] == 0), None)
    assert survivor is not None and survivor[1] == "error", f"rank 0 did not end with an error: {results}"
    elapsed = float(survivor[2].rsplit(" [after ", 1)[1].removesuffix(" s]"))
    assert elapsed < 5 + 25, f"rank 0 ended {elapsed:.1f} s after rank 1 failed"
    assert "rank 0: batch 0 was not sealed within 5 s" in survivor[2]
    assert "rank 1 holds unclosed groups" in survivor[2]
    if how == "raised":
        assert "rank 1: ValueError: reward function crashed on group" in survivor[2]
    else:
        assert codes[1] == 7 and "no rank reported a cause" in survivor[2]


def _hanging_rank(rank: int, world_size: int, port: int, out: Any) -> None:
    """Rank 1 hangs (alive, no failure) instead of reducing; rank 0's reduction must name it."""
    import os

    from thundersync.engine.distributed import DataParallel
    from thundersync.errors import DistributedError

    store = _connect(rank, world_size, port)
    dp = DataParallel(store=store, timeout_s=3)
    model = tiny_qwen3(torch.float64)
    if rank == 1:
        out.put((rank, "pid", str(os.getpid())))
        store.wait(["test/rank0-done"], datetime.timedelta(seconds=60))  # hangs past rank 0's timeout
        dist.destroy_process_group()
        return
    started = time.monotonic()
    try:
        dp.all_reduce_gradients(list(model.parameters()))
        out.put((rank, "finished", ""))
    except DistributedError as error:
        out.put((rank, "error", f"{error} [after {time.monotonic() - started:.1f} s]"))
    store.set("test/rank0-done", b"1")
    dist.destroy_process_group()


def test_a_rank_that_hangs_ends_the_others_reduction_within_the_timeout_with_a_line_naming_it() -> None:
    import socket

    results, _, _ = _spawn(_hanging_rank, 2)
    survivor = next(r for r in results if r[0] == 0)
    (pid,) = [r[2] for r in results if r[0] == 1]
    assert survivor[1] == "error", survivor
    message, elapsed = survivor[2].rsplit(" [after ", 1)
    assert float(elapsed.removesuffix(" s]")) < 10
    assert message.startswith(
        f"rank 0 of 2: rank 1 (host {socket.gethostname()}, pid {pid}, still running) did not reach the gradient "
        "reduction ("
    ), message
    assert "within 3 s and reported no failure: hung, or slower than that" in message
    assert "THUNDERSYNC_DIST_TIMEOUT_S" in message and "\n" not in message
    assert "timed out!" not in message.lower(), "not gloo's own words"


def _opd_batch(step: int, groups: int = 4) -> list[dict[str, Any]]:
    """Random OPD groups: turns with teacher log-probs for their scored tokens."""
    rng = random.Random(200 + step)
    out = []
    for _ in range(groups):
        trajectories = []
        for _ in range(rng.randint(1, 3)):
            turns = []
            for k in range(rng.randint(1, 2)):
                if k:
                    turns.append(([rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))], None))
                tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
                turns.append((tokens, [rng.uniform(-4.0, -0.1) for _ in tokens]))
            trajectories.append(turns)
        out.append({"prompt": [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))], "trajectories": trajectories})
    return out


def _stream_opd_group(opd: Any, index: int, group: dict[str, Any]) -> None:
    opd.open_group(index, group["prompt"])
    for t, turns in enumerate(group["trajectories"]):
        for tokens, teacher in turns:
            opd.append_turn(index, t, tokens, [teacher is not None] * len(tokens), teacher_logprobs=teacher)
        opd.close_trajectory(index, t)
    opd.close_group(index)


def _opd_train(normalization: str, data_parallel: Any = None, claims: Any = None) -> tuple[list[Any], list[Any]]:
    """Two steps through StreamingTrainer; with ``claims``, only the groups this rank claims."""
    import anyio

    import thundersync
    from thundersync.events import BatchReady

    model = tiny_qwen3(torch.float64)
    run = thundersync.StreamingRun(model, data_parallel=data_parallel)
    opd = thundersync.OPDStream(run, normalization=normalization)
    trainer = thundersync.StreamingTrainer(opd, torch.optim.AdamW(run.params, lr=1e-2))
    taken = []
    for step in range(STEPS):
        batch = _opd_batch(step)
        if claims is None:
            for index, group in enumerate(batch):
                _stream_opd_group(opd, index, group)
        else:
            while (index := claims.claim(step, len(batch))) is not None:
                _stream_opd_group(opd, index, batch[index])
                taken.append((step, index))
                claims.close(step, index, len(batch))
            claims.wait_sealed(step)
        anyio.run(trainer.step, BatchReady(batch_id=step, num_groups=len(batch)))
        if claims is not None:
            claims.finish(step)
    return taken, [p.detach().clone() for p in run.params]


def _opd_rank(rank: int, world_size: int, port: int, out: Any) -> None:
    from thundersync.engine.distributed import DataParallel

    _connect(rank, world_size, port)
    torch.set_num_threads(1)
    results = {}
    for normalization in ("token_mean", "sum"):
        dp = DataParallel(timeout_s=60)  # the default group's store carries the claims
        claims = GroupClaims(dp.store, rank=rank, world_size=world_size, prefix=f"opd/{normalization}", timeout_s=60)
        results[normalization] = _opd_train(normalization, dp, claims)
    out.put((rank, _dumps(results)))
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [3])  # uneven claims; 2 ranks: tests/app/cli/test_data_parallel.py
def test_opd_ranks_through_the_trainer_reach_the_single_process_parameters(world_size: int) -> None:
    """token_mean divides by the batch's global scored-token count, whatever each rank took."""
    results, codes, _ = _spawn(_opd_rank, world_size)
    assert codes == [0] * world_size, f"rank exit codes {codes}"
    by_rank = {rank: torch.load(io.BytesIO(blob)) for rank, blob in results}
    for normalization in ("token_mean", "sum"):
        _, want = _opd_train(normalization)
        claimed = sorted(item for rank in by_rank for item in by_rank[rank][normalization][0])
        assert claimed == [(s, i) for s in range(STEPS) for i in range(4)]
        for rank, trained in by_rank.items():
            error = _relative_error(trained[normalization][1], want)
            assert error < 1e-10, f"{normalization}, rank {rank}: relative error {error:.3g}"
