"""A rollout/learner split on gloo: rollout ranks generate with a TorchGenerator and send each
finished trajectory to the learner, which streams GRPO and broadcasts its weights after each step.

Two optimizer steps of the split equal the single-process run (one model that generates and
learns) in fp64; a rank of either role that dies mid-batch ends the other ranks with an error
naming it and its role. Processes are spawned and join one gloo group through a TCPStore served
by the test process (as in ``test_distributed``).
"""

from __future__ import annotations

import io
import os
import random
from typing import Any

import anyio
import msgspec
import pytest
import torch
import torch.distributed as dist

from tests.engine.test_distributed import _connect, _relative_error, _spawn
from tests.engine.tiny_models import tiny_qwen3, with_lora

pytestmark = pytest.mark.slow

VOCAB = 97
STEPS = 2
GROUPS = 3
GROUP_SIZE = 3


def _prompts(step: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(500 + step)
    return [(group, [rng.randrange(VOCAB) for _ in range(rng.randint(2, 5))]) for group in range(GROUPS)]


def _reward(prompt: list[int], tokens: list[int]) -> float:
    return float((sum(prompt) + 3 * sum(tokens)) % 5) / 4


def _seed(step: int) -> Any:
    return lambda group, index: 10_000 * step + 100 * group + index


def _params() -> Any:
    from thundersync.generation.base import SamplingParams

    return SamplingParams(temperature=1.0, max_new_tokens=4)


def _parts(model: torch.nn.Module) -> tuple[Any, Any, torch.optim.Optimizer]:
    import thundersync
    from thundersync.generation.torch_generator import TorchGenerator

    generator = TorchGenerator(model, max_batch=8, max_seq_len=32, deterministic=True)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model))
    return generator, grpo, torch.optim.AdamW(_trained(model), lr=1e-2, maximize=True)


def _model(lora: bool) -> torch.nn.Module:
    model = tiny_qwen3(torch.float64)
    return with_lora(model) if lora else model


def _trained(model: torch.nn.Module) -> list[torch.Tensor]:
    """What the learner trains and broadcasts: every parameter, or a LoRA model's adapter only."""
    return [p for p in model.parameters() if p.requires_grad]


def _single_process(lora: bool) -> list[torch.Tensor]:
    """The reference: one model generates each batch, then learns from it (no split, no channel)."""
    from thundersync.generation.base import GenerationRequest

    model = _model(lora)
    generator, grpo, optimizer = _parts(model)

    async def batch(step: int) -> None:
        for group, prompt in _prompts(step):
            grpo.open_group(group, prompt)
            for index in range(GROUP_SIZE):
                params = msgspec.structs.replace(_params(), seed=_seed(step)(group, index))
                result = await generator.generate(GenerationRequest(prompt_ids=prompt, params=params))
                tokens = list(result.token_ids)
                grpo.append_turn(group, index, tokens, [True] * len(tokens), behaviour_logprobs=result.logprobs)
                grpo.close_trajectory(group, index, _reward(prompt, tokens))
            grpo.close_group(group)

    for step in range(STEPS):
        anyio.run(batch, step)
        grpo.assert_safe_to_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _placement(world_size: int) -> Any:
    from thundersync.engine.split import Placement

    return Placement(learner=(0,), rollout=tuple(range(1, world_size)))


def _split_rank(rank: int, world_size: int, port: int, die: str, lora: bool, out: Any) -> None:
    """One rank of the split; ``die`` = "learner" or "rollout" makes that role's first rank exit
    without a word in the middle of the first batch."""
    from thundersync.engine.split import SplitChannel
    from thundersync.split import learn_batch

    store = _connect(rank, world_size, port)
    torch.set_num_threads(1)
    channel = SplitChannel(_placement(world_size), timeout_s=20, store=store)
    model = _model(lora)
    generator, grpo, optimizer = _parts(model)
    params = _trained(model)
    received = []
    try:
        for step in range(STEPS):
            if channel.role == "learner":
                if die == "learner":
                    next(iter(channel.receive()))
                    os._exit(3)
                received.append(learn_batch(channel, grpo, version=step))
                grpo.assert_safe_to_step()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                channel.broadcast_weights(params, step + 1)
            else:
                if die == "rollout" and rank == 1:
                    channel.send(_one_trajectory())
                    os._exit(3)
                received.append(anyio.run(_rollout_batch, channel, generator, step))
                version = channel.receive_weights(params)
                assert version == step + 1, f"rank {rank} received version {version} after step {step}"
    except Exception as error:
        channel.report_failure(error)
        causes = [repr(e) for e in getattr(error, "exceptions", [])][:1]
        out.put((rank, "error", f"{type(error).__name__}: {error} {causes}"))
        out.close()
        out.join_thread()  # os._exit would drop what the queue's feeder thread has not written yet
        os._exit(1)
    buffer = io.BytesIO()
    torch.save([p.detach() for p in model.parameters()], buffer)
    out.put((rank, received, buffer.getvalue()))
    dist.destroy_process_group()


async def _rollout_batch(channel: Any, generator: Any, step: int) -> int:
    from thundersync.split import generate_batch

    return await generate_batch(
        channel, generator, _prompts(step), group_size=GROUP_SIZE, reward=_reward, version=step, params=_params(),
        seed=_seed(step),
    )  # fmt: skip


def _one_trajectory() -> Any:
    from thundersync.engine.split import SplitTrajectory

    return SplitTrajectory(
        group_id=0, trajectory_id=0, group_size=GROUP_SIZE, prompt=[1, 2], tokens=[3], logprobs=[-1.0], reward=1.0,
        policy_version=0,
    )  # fmt: skip


@pytest.mark.parametrize(("world_size", "lora"), [(3, False)], ids=["2+1"])
def test_a_split_run_reaches_the_single_process_parameters(world_size: int, lora: bool) -> None:
    """2 rollout + 1 learner broadcasting every weight; GRPO, two steps with a broadcast after
    each; every rank's whole model compared. (1 rollout + 1 learner broadcasting a LoRA adapter
    only runs from a pipeline file: tests/app/cli/test_split_file_run.py.)"""
    results, codes, _ = _spawn(_split_rank, world_size, "", lora)
    assert codes == [0] * world_size, f"rank exit codes {codes}: {results}"
    by_rank = {rank: (received, torch.load(io.BytesIO(blob))) for rank, received, blob in results}
    assert by_rank[0][0] == [GROUPS * GROUP_SIZE] * STEPS, "the learner received every trajectory of each batch"
    sent = [sum(by_rank[rank][0][step] for rank in range(1, world_size)) for step in range(STEPS)]
    assert sent == [GROUPS * GROUP_SIZE] * STEPS, "the rollout ranks sent each trajectory once"
    want = _single_process(lora)
    for rank, (_, trained) in by_rank.items():
        error = _relative_error(trained, want)
        assert error < 1e-10, f"rank {rank}: relative error {error:.3g}"


@pytest.mark.parametrize("role", ["learner", "rollout"])
def test_a_rank_that_dies_mid_batch_ends_the_split_with_an_error_naming_it_and_its_role(role: str) -> None:
    results, codes, _ = _spawn(_split_rank, 2, role, False)
    dead, survivor = (0, 1) if role == "learner" else (1, 0)
    assert codes[dead] == 3, f"exit codes {codes}"
    assert codes[survivor] == 1, f"the surviving rank ended with an error: exit codes {codes}, {results}"
    [(rank, kind, message)] = results
    assert (rank, kind) == (survivor, "error")
    other = "rollout" if role == "learner" else "learner"
    assert f"rank {survivor} ({other})" in message, message
    assert f"rank {dead} ({role}, host " in message and ", no longer running)" in message, message
