"""A rollout/learner split under torchrun: the first ``--learners`` ranks learn, every other rank generates.

    torchrun --nproc-per-node 2 examples/split_grpo.py     # gloo on CPU; NCCL, one GPU a rank, with CUDA
    torchrun --nproc-per-node 4 examples/split_grpo.py --learners 2    # a learner sharded over 2 ranks

Each rollout rank samples its share of each batch's groups from a small random Qwen3 with the
built-in ``TorchGenerator`` and sends each trajectory to its group's learner rank when it
finishes; each learner rank streams GRPO per trajectory, the learner ranks reduce the gradient
(a ``ShardedDataParallel`` over ``channel.learner_group`` when there are several) and step, and
the first learner rank broadcasts the new weights, on which the next batch generates (decisions
081, 089). The reward is a toy one (the share of even token ids). Every rank prints one JSON
line: its role, the policy version it ends on and a checksum of its weights, which is the same on
every rank.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random

import anyio
import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM

import thundersync
from thundersync.engine.sharded import ShardedDataParallel
from thundersync.generation.base import SamplingParams
from thundersync.generation.torch_generator import TorchGenerator
from thundersync.split import Placement, SplitChannel, generate_batch, learn_batch

VOCAB, STEPS, GROUPS, GROUP_SIZE = 128, 2, 4, 4


def make_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config).to(device).eval()


def reward(prompt: list[int], tokens: list[int]) -> float:
    return sum(token % 2 == 0 for token in tokens) / len(tokens)


def prompts(step: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(step)
    return [(group, [rng.randrange(VOCAB) for _ in range(rng.randint(3, 8))]) for group in range(GROUPS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=1, help="learner ranks (the first ones); default 1")
    learners = parser.parse_args().learners
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    placement = Placement(learner=tuple(range(learners)), rollout=tuple(range(learners, dist.get_world_size())))
    channel = SplitChannel(placement, timeout_s=120)
    model = make_model(device)
    sharded = None
    if channel.role == "learner" and learners > 1:  # shards the model; its parameters are then the gathered ones
        sharded = ShardedDataParallel(model, channel.learner_group, timeout_s=120)
    params = list(model.parameters())
    version = 0
    try:
        if channel.role == "learner":
            grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model, data_parallel=sharded))
            optimizer = torch.optim.AdamW(params if sharded is None else sharded.parameters(), lr=1e-3, maximize=True)
            for _ in range(STEPS):
                learn_batch(channel, grpo, version=version)  # this rank's share: whole groups
                grpo.assert_safe_to_step()
                if sharded is not None:
                    sharded.all_reduce_gradients(grpo.run.params)  # once per batch, over the learner ranks
                optimizer.step()
                if sharded is not None:
                    sharded.stepped()  # the new shards gathered into params
                optimizer.zero_grad(set_to_none=True)
                version += 1
                channel.broadcast_weights(params, version)  # the first learner rank sends
        else:
            generator = TorchGenerator(model, max_batch=16, max_seq_len=64)
            for step in range(STEPS):
                rollout = functools.partial(
                    generate_batch, channel, generator, prompts(step), group_size=GROUP_SIZE, reward=reward,
                    version=version, params=SamplingParams(max_new_tokens=16),
                )  # fmt: skip
                anyio.run(rollout)
                version = channel.receive_weights(params)
    except Exception as error:
        channel.report_failure(error)  # the other ranks' errors name this rank's cause
        raise
    checksum = sum(float(p.detach().double().sum()) for p in params)
    print(json.dumps({"rank": channel.rank, "role": channel.role, "version": version, "checksum": checksum}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
