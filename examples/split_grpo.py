"""A rollout/learner split under torchrun: rank 0 learns, every other rank generates.

    torchrun --nproc-per-node 2 examples/split_grpo.py     # gloo on CPU; NCCL, one GPU a rank, with CUDA

Each rollout rank samples its share of each batch's groups from a small random Qwen3 with the
built-in ``TorchGenerator`` and sends each trajectory to the learner when it finishes; the
learner streams GRPO per trajectory, steps, and broadcasts the new weights, on which the next
batch generates (decision 081). The reward is a toy one (the share of even token ids). Every rank
prints one JSON line: its role, the policy version it ends on and a checksum of its weights,
which is the same on every rank.
"""

from __future__ import annotations

import functools
import json
import os
import random

import anyio
import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM

import thundersync
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
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    placement = Placement(learner=(0,), rollout=tuple(range(1, dist.get_world_size())))
    channel = SplitChannel(placement, timeout_s=120)
    model = make_model(device)
    params = list(model.parameters())
    version = 0
    try:
        if channel.role == "learner":
            grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model))
            optimizer = torch.optim.AdamW(params, lr=1e-3, maximize=True)
            for _ in range(STEPS):
                learn_batch(channel, grpo, version=version)
                grpo.assert_safe_to_step()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                version += 1
                channel.broadcast_weights(params, version)
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
