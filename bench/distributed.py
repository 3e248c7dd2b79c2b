"""Data-parallel streaming GRPO on CPU: 1 rank against 2 gloo ranks on the same batch.

    python bench/distributed.py            # ~1 min on a 2-core CPU machine
    python bench/distributed.py --tiny     # a few seconds: the CI check that it still runs
    python bench/distributed.py --sharded  # adds 2 ranks sharded (FSDP2) beside replicated
    python bench/distributed.py --sharded --cuda   # on 2 GPUs (NCCL), with each rank's peak GPU memory

Each configuration trains a small Qwen3 (fp32) for ``--steps`` optimizer steps (after one warm-up
step) on the same batches: ``--groups`` prompt groups of ``--samples`` trajectories per step, with
long-tailed response lengths. With 2 ranks, the groups are claimed at run time through the
store, each rank streams its groups, the batch is sealed, gradients are all-reduced and the
optimizer steps on every rank (AdamW, or ZeRO-1: ``ZeroRedundancyOptimizer`` over AdamW; with
``--sharded``, a sharded learner too: ``ShardedDataParallel``, the gradient reduce-scattered into
the shards, AdamW over them, the parameters gathered after each step). Each rank uses
``cores / ranks`` threads, so every configuration uses the whole machine.

Columns: median step time; groups each rank took (run-time claims); bytes reduced per step and
rank (all-reduced, or reduce-scattered's input); the bytes each rank holds between steps for its
parameters, their gradients and the optimizer's state (``rank_bytes``: sizes, not allocator
statistics; during a batch a sharded rank also holds the gathered parameters). Prints the header
and one markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import header, markdown_table

VOCAB = 512


def _model() -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    )
    return Qwen3ForCausalLM(config).eval()


def _batch(step: int, groups: int, samples: int) -> list[dict[str, Any]]:
    rng = random.Random(step)
    return [
        {
            "prompt": [rng.randrange(VOCAB) for _ in range(64)],
            "trajectories": [
                ([rng.randrange(VOCAB) for _ in range(min(16 + int(rng.lognormvariate(3, 1)), 512))], rng.random())
                for _ in range(samples)
            ],
        }
        for _ in range(groups)
    ]


def _stream(grpo: Any, index: int, group: dict[str, Any]) -> None:
    grpo.open_group(index, group["prompt"])
    for t, (tokens, reward) in enumerate(group["trajectories"]):
        grpo.append_turn(index, t, tokens, [True] * len(tokens))
        grpo.close_trajectory(index, t, reward)
    grpo.close_group(index)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, mode: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import thundersync
    from thundersync.engine.distributed import DataParallel
    from thundersync.engine.sharded import ShardedDataParallel, rank_bytes
    from thundersync.scheduling import GroupClaims

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    if args.cuda:  # one GPU per rank, NCCL
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.cuda else "gloo", store=store, rank=rank, world_size=world)
    model = _model().to(f"cuda:{rank}" if args.cuda else "cpu")
    dp = ShardedDataParallel(model, store=store) if mode == "sharded" else DataParallel(store=store)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model, data_parallel=dp))
    params = grpo.run.params
    stepped = dp.parameters() if isinstance(dp, ShardedDataParallel) else params
    if mode == "zero1":
        optimizer: Any = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4, maximize=True)
    else:
        optimizer = torch.optim.AdamW(stepped, lr=1e-4, maximize=True)
    claims = GroupClaims(store, rank=rank, world_size=world, prefix=f"bench/{mode}")
    times, taken = [], []
    for step in range(args.steps + 1):
        batch = _batch(step, args.groups, args.samples)
        dist.barrier()
        start = time.perf_counter()
        mine = 0
        while (index := claims.claim(step, len(batch))) is not None:
            _stream(grpo, index, batch[index])
            claims.close(step, index, len(batch))
            mine += 1
        claims.wait_sealed(step)
        grpo.assert_safe_to_step()
        before = dp.bytes_reduced
        if world > 1:
            dp.all_reduce_gradients(params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dp.stepped()
        claims.finish(step)
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
            taken.append(mine)
    peak = torch.cuda.max_memory_allocated() if args.cuda else 0  # the whole run's, warm-up step included
    held = rank_bytes(stepped, optimizer)
    out.put((rank, statistics.median(times), taken, dp.bytes_reduced - before, held, peak))
    dist.destroy_process_group()


def _run(world: int, args: argparse.Namespace, mode: str) -> list[Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, store.port, args, mode, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="2 groups of 2, one step: only checks that it runs")
    parser.add_argument("--sharded", action="store_true", help="add 2 ranks sharded (FSDP2) beside replicated")
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank (NCCL), with each rank's peak GPU memory")
    args = parser.parse_args()
    if args.tiny:
        args.groups, args.samples, args.steps = 2, 2, 1
    print(header("python bench/distributed.py " + " ".join(sys.argv[1:])))
    rows = []
    runs = [(1, "replicated"), (2, "replicated"), (2, "zero1")] + ([(2, "sharded")] if args.sharded else [])
    for world, mode in runs:
        results = _run(world, args, mode)
        held = [r[4] for r in results]
        rows.append(
            [
                f"{world} rank{'s' if world > 1 else ''}"
                + {"replicated": "", "zero1": ", ZeRO-1"}.get(mode, ", sharded"),
                max(r[1] for r in results),
                " / ".join(str(sum(r[2]) / len(r[2])) for r in results),
                results[0][3] / 2**20,
                *(" / ".join(f"{getattr(h, part) / 2**20:.2f}" for h in held) for part in _PARTS),
                *([" / ".join(f"{r[5] / 2**20:.1f}" for r in results)] if args.cuda else []),
            ]
        )
    columns = ["ranks", "step (s)", "groups per rank per step", "MiB reduced per rank"]
    peak = ["peak GPU MiB per rank"] if args.cuda else []
    print(markdown_table(columns + [f"{part} MiB per rank" for part in _PARTS] + peak, rows))


_PARTS = ("parameters", "gradients", "optimizer")


if __name__ == "__main__":
    main()
