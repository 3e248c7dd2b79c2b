"""Overlap benchmark: how much of the learner's work hides behind the rollout on one device.

    python bench/overlap.py                  # H200: bf16 Qwen3-0.6B-shaped random model, 8 x 8, long tail
    python bench/overlap.py --tiny           # CPU, tiny model, seconds (checks the script)
    python bench/overlap.py --rows grpo,opd  # a subset of the rows

The objects are called directly, in one process, as issue 14 measured (no pipeline): a
``TorchGenerator`` on the model samples every trajectory of the batch (temperature 1, no stop
token, each response as long as its drawn length: 64 x lognormal(1.5, 1) clipped to 64..2048,
prompts ~512, seeded), and each finished trajectory goes to the objective at once, on the event
loop's thread: ``RewardLinearBackward`` (GRPO, binary rewards) or ``OPDStream`` (its teacher, a
second random model on the same device, scores the trajectory first, in a worker thread). The
engine's work runs on its own worker thread and CUDA stream.

Columns, each measured in the same run:

- ``rollout``: the generation of the batch alone; ``learner``: the streamed learner alone over the
  same tokens, fed in the order they finished (OPD: teacher scoring included); ``dense``: the
  synchronous baseline's learner (padded micro-batches through transformers' forward,
  ``bench/engine.py``'s ``dense`` / ``bench/engine_opd.py``'s ``opd_dense``);
- ``sync``: rollout then learner (the two measured back to back); ``streamed``: the learner fed
  while the rollout runs, until ``assert_safe_to_step()`` returns;
- ``hidden``: the fraction of the learner's work hidden, (sync - streamed) / learner; ``speed-up``:
  sync / streamed; ``rollout slowdown``: the streamed run's time to its last trajectory over the
  rollout alone; ``tail``: from the last trajectory to the end of the step; tokens/s: generated
  tokens over the step's time.

Rows: GRPO with the default packing and with ``pack_tokens=0``, OPD, and a balanced GRPO
workload whose learner costs about as much as its rollout (prompts ~2048, responses
64 x lognormal(0.7, 0.5) clipped to 64..512), where the ceiling is close to 2x.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import thundersync
from bench._common import header, markdown_table
from bench.engine import Batch, Group, Trajectory, dense, make_model, padded_logprobs
from bench.engine_opd import OPDGroup, OPDTrajectory, opd_dense
from thundersync.generation import GenerationRequest, SamplingParams, TorchGenerator

Finished = tuple[int, int, list[int]]  # (group, trajectory, generated token ids)


@dataclass(frozen=True)
class Workload:
    """A batch's shape: groups x size trajectories, prompt lengths, response lengths."""

    groups: int
    size: int
    prompt: tuple[int, int]
    response: tuple[int, int]
    mu: float = 1.5  # response length = lo * exp(N(mu, sigma)), clipped
    sigma: float = 1.0


def make_plan(workload: Workload, vocab: int, seed: int) -> Batch:
    """Prompts, rewards and response lengths (the responses' tokens come from the generator)."""
    rng = random.Random(seed)
    lo, hi = workload.response
    batch = []
    for _ in range(workload.groups):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*workload.prompt))]
        trajectories = []
        for _ in range(workload.size):
            n = int(min(hi, max(lo, lo * math.exp(rng.gauss(workload.mu, workload.sigma)))))
            trajectories.append(Trajectory([0] * n, float(rng.random() < 0.5)))  # placeholder tokens
        batch.append(Group(prompt, trajectories))
    return batch


async def rollout(
    generator: TorchGenerator, plan: Batch, on_finished: Callable[[Finished], Awaitable[None]] | None = None
) -> tuple[float, list[Finished]]:
    """Generate every trajectory of ``plan`` concurrently; (seconds to the last one, in finish order)."""
    done: list[Finished] = []
    last = 0.0
    start = time.perf_counter()

    async def one(g: int, i: int) -> None:
        nonlocal last
        params = SamplingParams(
            temperature=1.0, max_new_tokens=len(plan[g].trajectories[i].response), seed=1000 * g + i
        )
        result = await generator.generate(GenerationRequest(prompt_ids=plan[g].prompt, params=params))
        last = time.perf_counter() - start
        done.append((g, i, result.token_ids))
        if on_finished is not None:
            await on_finished(done[-1])

    async with anyio.create_task_group() as tasks:
        for g, group in enumerate(plan):
            for i in range(len(group.trajectories)):
                tasks.start_soon(one, g, i)
    return last, done


class Learner:
    """Streams one batch into an objective: ``begin``, ``feed`` each finished trajectory, ``end``."""

    def __init__(self, objective: Any, plan: Batch, teacher: torch.nn.Module | None = None) -> None:
        self.objective, self.plan, self.teacher = objective, plan, teacher
        self.limiter = anyio.CapacityLimiter(1)  # one teacher forward at a time
        self.remaining: list[int] = []

    def begin(self) -> None:
        self.remaining = [len(group.trajectories) for group in self.plan]
        for g, group in enumerate(self.plan):
            self.objective.open_group(g, group.prompt)

    async def feed(self, finished: Finished) -> None:
        g, i, tokens = finished
        if self.teacher is None:
            self.objective.append_turn(g, i, tokens, [True] * len(tokens))
            self.objective.close_trajectory(g, i, self.plan[g].trajectories[i].reward)
        else:
            q = await anyio.to_thread.run_sync(
                teacher_logprobs, self.teacher, self.plan[g].prompt, tokens, limiter=self.limiter
            )
            self.objective.append_turn(g, i, tokens, [True] * len(tokens), teacher_logprobs=q)
            self.objective.close_trajectory(g, i)
        self.remaining[g] -= 1
        if self.remaining[g] == 0:
            self.objective.close_group(g)

    def end(self) -> None:
        self.objective.assert_safe_to_step()
        _sync()
        for p in self.objective.run.params:
            p.grad = None


def teacher_logprobs(teacher: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The teacher's log-prob of each response token (host fp64)."""
    with torch.no_grad():
        positions = list(range(len(prompt) - 1, len(prompt) + len(tokens) - 1))
        return padded_logprobs(teacher, [prompt + tokens], [positions]).double().cpu()


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


async def learner_alone(learner: Learner, finished: list[Finished]) -> float:
    start = time.perf_counter()
    learner.begin()
    for item in finished:
        await learner.feed(item)
    learner.end()
    return time.perf_counter() - start


async def streamed(generator: TorchGenerator, learner: Learner) -> tuple[float, float]:
    """(seconds of the whole step, seconds to the last trajectory) with the learner fed as they finish."""
    start = time.perf_counter()
    learner.begin()
    last, _ = await rollout(generator, learner.plan, learner.feed)
    learner.end()
    return time.perf_counter() - start, last


def dense_seconds(
    model: torch.nn.Module, plan: Batch, finished: list[Finished], teacher: torch.nn.Module | None
) -> float:
    """The synchronous learner's time over the same tokens (teacher scoring included for OPD)."""
    tokens = {(g, i): t for g, i, t in finished}
    _sync()
    start = time.perf_counter()
    if teacher is None:
        batch = [
            Group(gr.prompt, [Trajectory(tokens[g, i], t.reward) for i, t in enumerate(gr.trajectories)])
            for g, gr in enumerate(plan)
        ]
        dense(model, batch)
    else:
        groups = []
        for g, gr in enumerate(plan):
            trajs = [tokens[g, i] for i in range(len(gr.trajectories))]
            scores = [teacher_logprobs(teacher, gr.prompt, t).tolist() for t in trajs]
            groups.append(OPDGroup(gr.prompt, [OPDTrajectory([t], [q]) for t, q in zip(trajs, scores)]))
        opd_dense(model, groups)
    _sync()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


async def measure_row(
    name: str,
    model: torch.nn.Module,
    generator: TorchGenerator,
    learner: Learner,
    rollout_s: float,
    finished: list[Finished],
) -> list[Any]:
    """One row of the table (the rollout alone was measured once for the workload)."""
    learner_s = await learner_alone(learner, finished)
    dense_s = dense_seconds(model, learner.plan, finished, learner.teacher)
    step_s, last_s = await streamed(generator, learner)
    sync_s = rollout_s + learner_s
    tokens = sum(len(t) for _, _, t in finished)
    return [
        name,
        rollout_s,
        learner_s,
        dense_s,
        sync_s,
        step_s,
        f"{(sync_s - step_s) / learner_s:.0%}",
        sync_s / step_s,
        f"{last_s / rollout_s - 1:+.1%}",
        step_s - last_s,
        tokens / sync_s,
        tokens / step_s,
    ]


COLUMNS = [
    "row",
    "rollout s",
    "learner s",
    "dense learner s",
    "sync s",
    "streamed s",
    "hidden",
    "speed-up",
    "rollout slowdown",
    "tail s",
    "sync tok/s",
    "streamed tok/s",
]


def workloads(tiny: bool) -> dict[str, Workload]:
    if tiny:
        return {"main": Workload(2, 3, (12, 20), (4, 32)), "balanced": Workload(2, 3, (48, 64), (4, 12), 0.7, 0.5)}
    return {
        "main": Workload(8, 8, (480, 544), (64, 2048)),
        "balanced": Workload(8, 8, (1984, 2112), (64, 512), 0.7, 0.5),
    }


async def run_rows(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> list[list[Any]]:
    vocab = model.config.vocab_size
    shapes = workloads(args.tiny)
    rows: list[list[Any]] = []
    teacher: torch.nn.Module | None = None
    for workload_name in ("main", "balanced"):
        wanted = [r for r in args.rows if (r == "balanced") == (workload_name == "balanced")]
        if not wanted:
            continue
        workload = shapes[workload_name]
        plan = make_plan(workload, vocab, seed=0)
        longest = max(len(g.prompt) for g in plan) + workload.response[1] + 1
        generator = TorchGenerator(model, max_batch=min(64, workload.groups * workload.size), max_seq_len=longest)
        await rollout(generator, plan)  # warm-up: decode graphs for every key length, kernels, allocator
        rollout_s, finished = await rollout(generator, plan)
        print(f"[done] {workload_name} rollout alone: {rollout_s:.2f} s", file=sys.stderr, flush=True)
        for row in wanted:
            if row == "opd" and teacher is None:
                teacher = make_teacher(args.tiny, device, next(model.parameters()).dtype)
            objective = make_objective(row, thundersync.StreamingRun(model))
            warm = Learner(objective, plan[:1], teacher if row == "opd" else None)  # probes, allocator
            await learner_alone(warm, [item for item in finished if item[0] == 0])
            dense_seconds(model, plan[:1], finished, warm.teacher)  # the dense path's kernels and autotuning
            learner = Learner(objective, plan, teacher if row == "opd" else None)
            rows.append(await measure_row(_ROW_NAMES[row], model, generator, learner, rollout_s, finished))
            print(f"[done] {markdown_table(COLUMNS, rows[-1:]).splitlines()[-1]}", file=sys.stderr, flush=True)
    return rows


def make_objective(row: str, run: thundersync.StreamingRun) -> Any:
    if row == "opd":
        return thundersync.OPDStream(run)
    return thundersync.RewardLinearBackward(run, pack_tokens=0 if row == "grpo-pack0" else 8192)


def make_teacher(tiny: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A second model of the student's shape (other weights), frozen."""
    teacher = make_model(tiny, device, dtype).requires_grad_(False)
    generator = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=generator, device=device, dtype=p.dtype), alpha=0.02)
    return teacher


_ROW_NAMES = {
    "grpo": "GRPO, pack_tokens=8192 (default)",
    "grpo-pack0": "GRPO, pack_tokens=0",
    "opd": "OPD (teacher on the same device)",
    "balanced": "balanced GRPO (prompts ~2048, short responses)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and batch on CPU (seconds)")
    parser.add_argument(
        "--rows", default="grpo,opd,grpo-pack0,balanced", help=f"comma-separated, of {', '.join(_ROW_NAMES)}"
    )
    args = parser.parse_args()
    args.rows = args.rows.split(",")
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    model = make_model(args.tiny, device, torch.bfloat16 if cuda else torch.float32)
    rows = anyio.run(run_rows, args, model, device)
    print(header(" ".join(["python", *sys.argv])))
    shapes = workloads(args.tiny)
    print(f"workload: {shapes['main']}; balanced: {shapes['balanced']}; dtype {next(model.parameters()).dtype}\n")
    print(markdown_table(COLUMNS, rows))


if __name__ == "__main__":
    main()
