"""A rollout/learner split on gloo: rollout ranks generate with a TorchGenerator and send each
finished trajectory to its group's learner rank, which streams GRPO; the learner ranks reduce
(a sharded learner of two) and step, and the first one broadcasts the weights after each step.

Two optimizer steps of the split equal the single-process run (one model that generates and
learns) in fp64; a rank of either role that dies mid-batch ends every other rank with an error
naming it and its role. Each run makes two channels on one store, with the same prefix, and
alternates them by step (their store keys must not collide). The processes join one gloo group
through a TCPStore served by the test process (as in ``test_distributed``); they are forked from
a fork server that imported the models' and the split's modules once (``PRELOAD``), which saves
each process that import.
"""

from __future__ import annotations

import io
import os
import random
import re
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
PRELOAD = (
    "tests.engine.test_split_distributed",
    "transformers.models.qwen3.modeling_qwen3",
    "peft",
    "thundersync.split",
    "thundersync.engine.sharded",
    "thundersync.generation.torch_generator",
)


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


LAYOUTS = {  # (rollout ranks, learner ranks); the learners of two interleave with the rollout ranks
    "1+1-lora": ((1,), (0,)),
    "2+2-sharded": ((0, 2), (1, 3)),
    "2+2-replicated": ((0, 2), (1, 3)),
}


def _split_rank(rank: int, world_size: int, port: int, layout: str, die: str, out: Any) -> None:
    """One rank of the split; ``die`` = "learner" or "rollout" makes that role's last rank exit
    without a word in the middle of the first batch; "reduce": after the steps (and their
    results), the last learner rank exits after learning its share of one more batch, before the
    gradient reduction. Two learner ranks shard the model, or replicate it (layout ``-replicated``)."""
    from thundersync.engine.split import Placement, SplitChannel

    store = _connect(rank, world_size, port)
    torch.set_num_threads(1)
    rollout, learner = LAYOUTS[layout]
    placement = Placement(rollout=rollout, learner=learner)
    channels = [SplitChannel(placement, timeout_s=20, store=store) for _ in range(2)]  # one prefix
    model = _model(lora=layout.endswith("lora"))
    learn = _learner(channels[0], model, store, layout) if channels[0].role == "learner" else None
    generator = None if learn is not None else _parts(model)[0]
    params = _trained(model)  # a sharded learner's gathered parameters
    received = []
    try:
        for step in range(STEPS):
            channel = channels[step % 2]
            if die == channel.role and rank == max(getattr(placement, die)):
                _die(channel)
            if learn is not None:
                received.append(learn(channel, step, params))
            else:
                received.append(anyio.run(_rollout_batch, channel, generator, step))
                version = channel.receive_weights(params)
                assert version == step + 1, f"rank {rank} received version {version} after step {step}"
        _put_result(out, rank, received, model)
        if die == "reduce":
            if learn is not None:
                learn(channels[STEPS % 2], STEPS, params, exit_before_reduce=rank == max(learner))
            else:
                anyio.run(_rollout_batch, channels[STEPS % 2], generator, STEPS)
                channels[STEPS % 2].receive_weights(params)
    except Exception as error:
        channels[0].report_failure(error)
        causes = [repr(e) for e in getattr(error, "exceptions", [])][:1]
        out.put((rank, "error", f"{type(error).__name__}: {error} {causes}"))
        out.close()
        out.join_thread()  # os._exit would drop what the queue's feeder thread has not written yet
        os._exit(1)
    dist.destroy_process_group()


def _put_result(out: Any, rank: int, received: list[int], model: torch.nn.Module) -> None:
    buffer = io.BytesIO()
    torch.save([p.detach() for p in model.parameters()], buffer)
    out.put((rank, received, buffer.getvalue(), os.getpid()))


def _learner(channel: Any, model: torch.nn.Module, store: Any, layout: str) -> Any:
    """A learner rank's step: learn its share of the batch, reduce over the learner ranks (a
    sharded model when there are several, or replicas: a DataParallel over the learner group),
    step, broadcast from the first learner rank."""
    import thundersync
    from thundersync.engine.distributed import DataParallel
    from thundersync.engine.sharded import ShardedDataParallel
    from thundersync.split import learn_batch

    several, group = len(channel.placement.learner) > 1, channel.learner_group
    sharded: Any = ShardedDataParallel(model, group, store=store, timeout_s=20) if several else None
    if several and layout.endswith("replicated"):
        sharded = DataParallel(group, store=store, timeout_s=20)
        sharded.broadcast_parameters(_trained(model))  # the learner group's first rank's (group_src)
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model, data_parallel=sharded))
    trained = sharded.parameters() if isinstance(sharded, ShardedDataParallel) else _trained(model)
    optimizer = torch.optim.AdamW(trained, lr=1e-2, maximize=True)

    def learn(channel: Any, step: int, params: list[torch.Tensor], exit_before_reduce: bool = False) -> int:
        count = learn_batch(channel, grpo, version=step)
        grpo.assert_safe_to_step()
        if exit_before_reduce:
            os._exit(3)
        if sharded is not None:
            sharded.all_reduce_gradients(grpo.run.params)
        optimizer.step()
        if sharded is not None:
            sharded.stepped()  # the gathered parameters (params) hold the new weights
        optimizer.zero_grad(set_to_none=True)
        channel.broadcast_weights(params, step + 1)
        return count

    return learn


def _die(channel: Any) -> None:
    """Exit without a word mid-batch: a learner after its first trajectory, a rollout rank after one send."""
    if channel.role == "learner":
        next(iter(channel.receive()))
    else:
        channel.send(_one_trajectory(), channel.placement.learner[0])
    os._exit(3)


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


@pytest.mark.parametrize("layout", ["2+2-replicated"])  # sharded, from a file: tests/app/cli/test_split_file_run.py
def test_a_split_run_reaches_the_single_process_parameters(layout: str) -> None:
    """2 rollout + 2 learner ranks (replicas: a DataParallel over the learner group, receiving
    unequal shares of whole groups) broadcasting every weight; GRPO, two steps with a broadcast
    after each; every rank's whole model compared. (1 rollout + 2 sharded learner ranks
    broadcasting a LoRA adapter only run from a pipeline file: tests/app/cli/test_split_file_run.py;
    the sharded learner's death: the next test.) The 2+2 run goes on
    (sharing its processes with a death test): in a third batch, the last learner rank exits before
    the gradient reduction, and every other rank ends with an error naming it."""
    rollout, learner = LAYOUTS[layout]
    world_size = len(rollout) + len(learner)
    sharded = len(learner) > 1  # several learners: sharded or replicated
    die, expect = ("reduce", 2 * world_size - 1) if sharded else ("", world_size)
    results, codes, _ = _spawn(_split_rank, world_size, layout, die, preload=PRELOAD, expect=expect)
    if sharded:
        errors, results = [r for r in results if r[1] == "error"], [r for r in results if r[1] != "error"]
        _check_errors(errors, codes, learner, max(learner), "learner")
        pids = {rank: pid for rank, _, _, pid in results}
        for _, _, message in errors:  # each rank named with its own process (world ranks in the store)
            named = re.findall(r"rank (\d+) \((?:learner|rollout), host [^,]+, pid (\d+)", message)
            assert named and all(int(pid) == pids[int(n)] for n, pid in named), f"pids {pids}: {message}"
    else:
        assert codes == [0] * world_size, f"rank exit codes {codes}: {results}"
    by_rank = {rank: (received, torch.load(io.BytesIO(blob))) for rank, received, blob, _ in results}
    assert sorted(by_rank) == list(range(world_size)), f"results from ranks {sorted(by_rank)}"
    learned = [[by_rank[rank][0][step] for rank in learner] for step in range(STEPS)]
    assert [sum(counts) for counts in learned] == [GROUPS * GROUP_SIZE] * STEPS, f"learned {learned}"
    assert all(min(counts) > 0 for counts in learned), f"every learner rank learns a share: {learned}"
    sent = [sum(by_rank[rank][0][step] for rank in rollout) for step in range(STEPS)]
    assert sent == [GROUPS * GROUP_SIZE] * STEPS, "the rollout ranks sent each trajectory once"
    want = _single_process(lora=layout.endswith("lora"))
    for rank, (_, trained) in by_rank.items():
        error = _relative_error(trained, want)
        assert error < 1e-10, f"rank {rank}: relative error {error:.3g}"


@pytest.mark.parametrize(("role", "layout"), [("learner", "2+2-sharded"), ("rollout", "1+1-lora")])
def test_a_rank_that_dies_mid_batch_ends_the_split_with_an_error_naming_it_and_its_role(role: str, layout: str) -> None:
    """A learner of two (not the one that broadcasts) or a rollout rank exits mid-batch: every
    other rank, of either role, ends with an error naming itself and the dead rank with its role."""
    rollout, learner = LAYOUTS[layout]
    world_size = len(rollout) + len(learner)
    results, codes, _ = _spawn(_split_rank, world_size, layout, role, preload=PRELOAD)
    _check_errors(results, codes, learner, max(learner if role == "learner" else rollout), role)


def _check_errors(results: list[Any], codes: list[int | None], learner: tuple[int, ...], dead: int, role: str) -> None:
    """Rank ``dead`` exited (3), every other rank ended with an error (1) naming itself with its
    role, and ``dead`` with its role as no longer running."""
    assert codes[dead] == 3, f"exit codes {codes}"
    survivors = [rank for rank in range(len(codes)) if rank != dead]
    assert [codes[rank] for rank in survivors] == [1] * len(survivors), f"exit codes {codes}, {results}"
    assert sorted((rank, kind) for rank, kind, _ in results) == [(rank, "error") for rank in survivors]
    for rank, _, message in results:
        own = "learner" if rank in learner else "rollout"
        assert message.startswith(f"DistributedError: rank {rank} ({own})"), message
        assert re.search(rf"rank {dead} \({role}, host [^,]+, pid \d+, no longer running\)", message), message
