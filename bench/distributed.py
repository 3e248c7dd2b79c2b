"""Data-parallel streaming GRPO: 1 rank against 2 ranks on the same batch (gloo on CPU, NCCL on GPUs).

    python bench/distributed.py            # ~1 min on a 2-core CPU machine
    python bench/distributed.py --tiny     # a few seconds: the CI check that it still runs
    python bench/distributed.py --gpu      # 1 GPU vs 2 GPUs replicated, NCCL (needs 2 CUDA devices)
    python bench/distributed.py --sharded  # adds 2 ranks sharded (FSDP2) beside replicated (with --gpu too)

Each configuration trains a small Qwen3 (fp32; ``--gpu``: a larger one in bf16) for ``--steps``
optimizer steps (after one warm-up step) on the same batches: ``--groups`` prompt groups of
``--samples`` trajectories per step, with long-tailed response lengths. With 2 ranks, the groups
are claimed at run time through the store, each rank streams its groups, the batch is sealed,
gradients are all-reduced and the optimizer steps on every rank (AdamW, or ZeRO-1:
``ZeroRedundancyOptimizer`` over AdamW; with ``--sharded``, a sharded learner too:
``ShardedDataParallel``, the gradient reduce-scattered into the shards, AdamW over them, the new
shards gathered after each step). On CPU each rank uses ``cores / ranks`` threads, so both
configurations use the whole machine; with ``--gpu`` rank r runs on ``cuda:r`` (replicated AdamW
only) and the last line is the throughput ratio of 2 GPUs to 1 (the target is 1.8x or more).

Columns: median step time; batch tokens per second (the timed steps' tokens over their summed
step times, each step's time the slowest rank's); groups each rank took (run-time claims); bytes
reduced per step and rank (all-reduced, or the reduce-scatter's input); the bytes each rank holds
for its parameters, their gradients and the optimizer's state (``rank_bytes``: sizes, not
allocator statistics; a sharded rank also holds the gathered weights); with ``--gpu``, each rank's
peak GPU memory. Prints the header and one markdown table.
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


def _model(gpu: bool) -> Any:
    """The CPU model (fp32), or on ``--gpu`` a larger one in bf16 on this rank's CUDA device."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if gpu:
        config = Qwen3Config(
            vocab_size=32768,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=4096,
        )
    else:
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
    model = Qwen3ForCausalLM(config).eval()
    return model.to("cuda", torch.bfloat16) if gpu else model


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
    if args.gpu:
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl" if args.gpu else "gloo", store=store, rank=rank, world_size=world)
    model = _model(args.gpu)
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
        if args.gpu:
            torch.cuda.synchronize()
        claims.finish(step)
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
            taken.append(mine)
    peak = torch.cuda.max_memory_allocated() if args.gpu else 0  # the whole run's, warm-up step included
    out.put((rank, times, taken, dp.bytes_reduced - before, rank_bytes(stepped, optimizer), peak))
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


def _tokens(args: argparse.Namespace) -> int:
    """The timed steps' batch tokens (prompts and responses)."""
    batches = [_batch(step, args.groups, args.samples) for step in range(1, args.steps + 1)]
    return sum(len(g["prompt"]) + sum(len(t) for t, _ in g["trajectories"]) for b in batches for g in b)


def _row(label: str, results: list[Any], tokens: int, gpu: bool) -> tuple[list[Any], float]:
    """A table row of one configuration, and its throughput (batch tokens per second)."""
    steps = [max(times) for times in zip(*(r[1] for r in results))]  # each step: the slowest rank's time
    throughput = tokens / sum(steps)
    return [
        label,
        statistics.median(steps),
        throughput,
        " / ".join(str(sum(r[2]) / len(r[2])) for r in results),
        results[0][3] / 2**20,
        *(" / ".join(f"{getattr(r[4], part) / 2**20:.2f}" for r in results) for part in _PARTS),
        *([" / ".join(f"{r[5] / 2**20:.1f}" for r in results)] if gpu else []),
    ], throughput


_PARTS = ("parameters", "gradients", "optimizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="2 groups of 2, one step: only checks that it runs")
    parser.add_argument("--gpu", action="store_true", help="1 GPU vs 2 GPUs replicated (NCCL), bf16")
    parser.add_argument("--sharded", action="store_true", help="add 2 ranks sharded (FSDP2) beside replicated")
    args = parser.parse_args()
    if args.tiny:
        args.groups, args.samples, args.steps = 2, 2, 1
    configurations = [(1, "replicated"), (2, "replicated"), (2, "zero1")]
    if args.gpu:
        import torch

        if torch.cuda.device_count() < 2:
            parser.exit(2, f"--gpu needs 2 CUDA devices; this machine has {torch.cuda.device_count()}\n")
        configurations = [(1, "replicated"), (2, "replicated")]
    configurations += [(2, "sharded")] if args.sharded else []
    print(header("python bench/distributed.py " + " ".join(sys.argv[1:])))
    rows, throughputs, tokens = [], [], _tokens(args)
    unit = "GPU" if args.gpu else "rank"
    for world, mode in configurations:
        label = f"{world} {unit}{'s' if world > 1 else ''}" + {"zero1": ", ZeRO-1", "sharded": ", sharded"}.get(
            mode, ""
        )
        row, throughput = _row(label, _run(world, args, mode), tokens, args.gpu)
        rows.append(row)
        throughputs.append(throughput)
    columns = ["ranks", "step (s)", "tokens/s", "groups per rank per step", "MiB reduced per rank"]
    columns += [f"{part} MiB per rank" for part in _PARTS] + (["peak GPU MiB per rank"] if args.gpu else [])
    print(markdown_table(columns, rows))
    if args.gpu:
        print(f"throughput 2 GPUs / 1 GPU: {throughputs[1] / throughputs[0]:.2f}x (target: 1.8x or more)")


if __name__ == "__main__":
    main()
