"""Overlap benchmark: how much of the learner's work hides behind the rollout on one device.

    python bench/overlap.py                  # H200: bf16 Qwen3-0.6B-shaped random model, 8 x 8, long tail
    python bench/overlap.py --tiny           # CPU, tiny model, seconds (checks the script)
    python bench/overlap.py --rows grpo,opd  # a subset of the rows
    python bench/overlap.py --repeat 3       # each cell the median of 3 runs of its row, the rows interleaved
    python bench/overlap.py --rows grpo,grpo-pack2048 --learner-sms 64,80,96,112   # the learner on green contexts
    python bench/overlap.py --rows opd --gpu-window 3 0.5   # and the CUDA streams' activity 3..3.5 s into the streamed run
    python bench/overlap.py --rows opd --gpu-window 3 0.5 --trace traces   # and every thread's ops as a Chrome trace

The objects are called directly, in one process, as issue 14 measured (no pipeline; the
``-2proc`` rows use two, see below): a
``TorchGenerator`` on the model samples every trajectory of the batch (temperature 1, no stop
token, each response as long as its drawn length: 64 x lognormal(1.5, 1) clipped to 64..2048,
prompts ~512, seeded), and each finished trajectory goes to the objective at once, on the event
loop's thread: ``RewardLinearBackward`` (GRPO, binary rewards) or ``OPDStream`` (its teacher, a
second random model on the same device, scores the trajectory first, in a worker thread, through
``PackedScorer`` as ``TransformersTeacher`` does: CUDA graphs of packed forwards). The
engine's work runs on its own worker thread and CUDA stream.

Columns, each measured in the same run:

- ``rollout``: the generation of the batch alone, the mean of a run before the round of the
  workload's rows and one after it (its time moves by several percent between runs; all are
  printed under the table); ``learner``: the streamed learner alone over the
  same tokens, fed in the order they finished (OPD: teacher scoring included); ``dense``: the
  synchronous baseline's learner (padded micro-batches through transformers' forward,
  ``bench/engine.py``'s ``dense`` / ``bench/engine_opd.py``'s ``opd_dense``);
- ``sync``: rollout then learner (the two measured back to back); ``streamed``: the learner fed
  while the rollout runs, until ``assert_safe_to_step()`` returns (the row's second such run, as a
  training run's later steps: the first captures the CUDA graphs of packs formed beside a
  rollout, which ``stream_early`` forms differently from the warm-up's; ``--cold-streamed``
  measures the first; the timeline says how many captures the measured run still made);
- ``hidden``: the fraction of the learner's work hidden, (sync - streamed) / learner; ``speed-up``:
  sync / streamed; ``rollout slowdown``: the streamed run's time to its last trajectory over the
  rollout alone; ``price``: that slowdown in seconds per second of the learner's work,
  (time to the last trajectory - rollout) / learner (``bench/interference.py`` measures it for
  synthetic loads); ``tail``: from the last trajectory to the end of the step, and ``tail /
  learner``, that over the learner alone (issue 44's target: at most 10%); tokens/s: generated
  tokens over the step's time.

``--repeat N`` (default 1) measures each row N times in the one call, in rounds: row A, row B, ...,
then all of them again, so that a drift of the machine meets every row alike; the rollout alone
runs before the first round and after each, and a run's columns are computed against the mean of
the two around its round. Each cell of the table is then the median of its column's N per-run
values (each column on its own: the median speed-up is not the median sync over the median
streamed), and ``hidden``, ``rollout slowdown`` and ``tail / learner`` add the runs' least and
greatest value, ``41% (38%..44%)``; a second table lists every run's row, and the timelines and
gradient checks say which run they are.

Rows: GRPO with the default packing (``grpo``: ``pack_tokens`` by placement, 8192 here and 0 on a
green context; ``tail_groups`` 0: branches wait for 8192 tokens or their group's close), the same
with ``tail_groups = 2`` (``grpo-tail2``: the bench opens every group before the rollout, whose
slots start every trajectory at once, and tells the objective ``all_groups_opened()`` then, as the
backward stage would, so once only two groups are open each of their trajectories' backward starts
at its close), with
``stream_early=True`` (``grpo-early``: a close that finds the worker idle submits what waits),
with ``pack_tokens=2048`` (``grpo-pack2048``: packs the whole-pack graphs hold) and with
``pack_tokens=0``, OPD, and a balanced GRPO workload whose streamed learner costs about as much as
its rollout: 32 x 8 trajectories through the generator's 256 slots (a finished one's slot takes
the next, so the decode batch stays full and trajectories finish all through the rollout), prompts
~512, responses 64 x lognormal(1.2, 0.4) clipped to 64..1024 (``--balanced`` gives another shape).
The streamed learner shares a group's prompt, so it needs far more trajectories per second of
rollout than the dense one to be comparable: on the H200 this learner is 3.0 s against a 5.1 s
rollout. The ``ceiling`` column is the best a step can do, (rollout + learner) / max(rollout,
learner).

The ``-greenN`` rows (any in-process row, e.g. ``grpo-green64``; ``--learner-sms 64,96`` adds
``grpo-green64`` and ``grpo-green96``) run the row with ``Acceleration(learner_sms=N)``: the
engine's streams and the graphs it captures on a CUDA green context of N SMs (a multiple of 8), so
GRPO's default packing is ``pack_tokens = 0``; the generator keeps its own high-priority stream on
the whole device. With a ``d`` (``grpo-green64d``) the row's rollout runs on a generator of its own
with ``decode_partition`` on: its decode stream and graphs on the SMs the learner's partition
leaves (its rollout alone there is noted below the table; the row's columns compare with the
rollout alone on the whole device). They need a GPU and driver with green contexts and ``cuda.bindings``.

The ``-proc`` rows (``grpo-proc``, ``opd-proc``) are the in-process rows with the objective a
``thundersync.LearnerProcess`` (the library's learner process: the engine's work in a child over
the same parameters, the gradient back in this process's ``.grad``, the teacher here).

The ``-2proc`` rows (``grpo-2proc``, ``opd-2proc``, ``balanced-2proc``) run the same workloads and
objectives with the learner in a second process (issue 14's alternative to threads that share one
GIL; ``thundersync.engine.process.ModelProcess`` starts it). The parent keeps the model and the ``TorchGenerator`` and sends each finished trajectory
(group, index, token ids) down a queue as it finishes. The child, started with
``torch.multiprocessing`` (spawn), one per row, owns everything else: the ``StreamingRun`` and its objective,
the engine's worker thread, for OPD the teacher (it scores in the child), and the gradient in its
own ``.grad``. It receives the parameters through ``torch.multiprocessing`` (a CUDA tensor
travels as an IPC handle of the parent's memory: zero copy; on CPU the storage moves into shared
memory) and builds the model on the meta device around them, so its parameters are the parent's
storage; a write in the child that the parent reads back proves it once at start. On the batch's
end message the child runs ``assert_safe_to_step()``, synchronizes and answers; ``streamed`` is
measured in the parent from the batch's start to that answer, ``learner`` in the child alone,
``dense`` in the parent. Each ``-2proc`` row also compares the child's gradient with this
process's streamed gradient over the same trajectories (printed under the table).

The product form of the second process is ``thundersync.LearnerProcess`` (the ``-proc`` rows):
there the optimizer, the teacher and the gradient stay in the parent, and only the engine's work
runs in the child. The ``-gpu2`` rows (``grpo-gpu2``, ``opd-gpu2``, ``balanced-gpu2``) put that
child on a second GPU, ``LearnerProcess(..., device="cuda:1")``: its own copy of the parameters
there, taken again at every batch, the gradient copied back (they need two CUDA devices; on the CPU
the child computes on a private copy).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import gzip
import math
import random
import re
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import thundersync
from bench._common import engine_layers, header, markdown_table, release_engine_graphs
from bench.engine import Batch, Group, Trajectory, dense, make_model
from bench.engine_opd import OPDGroup, OPDTrajectory, opd_dense
from thundersync.acceleration import Acceleration
from thundersync.engine import graph_counts
from thundersync.engine._worker import Worker
from thundersync.engine.process import ModelProcess
from thundersync.engine.process.messages import Message, Stop
from thundersync.generation import GenerationRequest, SamplingParams, TorchGenerator
from thundersync.generation._batcher import ContinuousBatcher
from thundersync.grpo.stream import default_pack_tokens
from thundersync.model.scoring import PackedScorer

Finished = tuple[int, int, list[int]]  # (group, trajectory, generated token ids)


@dataclass(frozen=True)
class Workload:
    """A batch's shape: groups x size trajectories, prompt lengths, response lengths, and the
    generator's slots (sequences decoded at once; a finished one's slot takes the next)."""

    groups: int
    size: int
    prompt: tuple[int, int]
    response: tuple[int, int]
    mu: float = 1.5  # response length = lo * exp(N(mu, sigma)), clipped
    sigma: float = 1.0
    slots: int = 64


class Timeline:
    """Host spans of this process's engine jobs, teacher forwards and generator steps (wall clock),
    to tell where a streamed step's tail comes from: a learner that fell behind (its jobs run after
    the last trajectory) or a slow one."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {"engine": [], "teacher": [], "decode": []}

    def install(self) -> None:
        """Wrap the engine worker's job runner and the batcher's step (for the whole process)."""
        for kind, owner, name in (("engine", Worker, "_run"), ("decode", ContinuousBatcher, "step")):
            setattr(owner, name, self.timed(kind, getattr(owner, name)))

    def timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.span(kind):
                return fn(*args, **kwargs)

        return wrapper

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans[kind].append((start, time.perf_counter()))

    def summary(self, start: float, last: float, end: float, alone_step_ms: float) -> str:
        """Busy seconds of each kind during the rollout (start..last) and after it (last..end)."""
        parts = []
        for kind in ("engine", "teacher"):
            spans = [(a, b) for a, b in self.spans[kind] if b > start and a < end]
            if not spans:
                continue
            during = sum(min(b, last) - max(a, start) for a, b in spans if a < last)
            after = sum(b - max(a, last) for a, b in spans if b > last)
            parts.append(f"{kind} {len(spans)} calls, busy {during:.2f} s during the rollout, {after:.2f} s after")
        steps = self.steps(start, last)
        if steps:
            parts.append(
                f"decode {len(steps)} steps, median {1e3 * statistics.median(steps):.2f} ms "
                f"(rollout alone {alone_step_ms:.2f} ms)"
            )
        return "; ".join(parts)

    def busy(self, start: float, end: float) -> str:
        """Busy seconds of each learner kind within start..end (a run without a rollout)."""
        parts = []
        for kind in ("engine", "teacher"):
            spans = [(a, b) for a, b in self.spans[kind] if start <= a and b <= end]
            if spans:
                parts.append(f"{kind} {len(spans)} calls, busy {sum(b - a for a, b in spans):.2f} s")
        return "; ".join(parts)

    def steps(self, start: float, end: float) -> list[float]:
        """The seconds of each generator step within start..end."""
        return [b - a for a, b in self.spans["decode"] if start <= a and b <= end]

    def median_step_ms(self, start: float, end: float) -> float:
        steps = self.steps(start, end)
        return 1e3 * statistics.median(steps) if steps else float("nan")


TIMELINE = Timeline()


def stream_activity(events: list[Any], seconds: float) -> str:
    """Per CUDA stream: kernels, busy seconds (the union of its kernels' spans), and for the two
    busiest streams the seconds both ran kernels at once (kineto events of one profiler window)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0 and "emcpy" not in e.name():
            spans.setdefault(e.device_resource_id(), []).append((e.start_ns(), e.start_ns() + e.duration_ns()))

    def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
        merged: list[tuple[int, int]] = []
        for a, b in sorted(intervals):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return merged

    busy = {stream: union(s) for stream, s in spans.items()}
    total = {stream: sum(b - a for a, b in merged) for stream, merged in busy.items()}
    ranked = sorted(busy, key=lambda stream: -total[stream])
    parts = [f"stream {stream}: {len(spans[stream])} kernels, busy {total[stream] / 1e9:.3f} s" for stream in ranked]
    if len(ranked) >= 2:
        first, second = busy[ranked[0]], busy[ranked[1]]
        both, i, j = 0, 0, 0
        while i < len(first) and j < len(second):
            both += max(0, min(first[i][1], second[j][1]) - max(first[i][0], second[j][0]))
            if first[i][1] < second[j][1]:
                i += 1
            else:
                j += 1
        parts.append(f"the two busiest both busy {both / 1e9:.3f} s")
    return f"GPU window of {seconds} s: " + ("; ".join(parts) or "no kernels")


async def gpu_window(offset: float, seconds: float, out: list[str], trace: Path | None = None) -> None:
    """Profile the device's kernels from ``offset`` to ``offset + seconds`` into the rollout;
    ``trace``: also every thread's host ops, written there as a gzipped Chrome trace."""
    await anyio.sleep(offset)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    plain = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU  # CPU: no streams
    activities = {plain}
    if trace is not None:
        activities.add(torch.profiler.ProfilerActivity.CPU)
    options: dict[str, Any] = {}
    if trace is not None:  # every thread's ops, not only this one's (the engine's worker, autograd's, the generator's)
        options["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    profiler = torch.profiler.profile(activities=list(activities), **options)
    profiler.start()
    await anyio.sleep(seconds)
    profiler.stop()
    out.append(stream_activity(profiler.profiler.kineto_results.events(), seconds))
    if trace is not None:
        raw = trace.with_suffix("")  # x.json.gz -> x.json
        profiler.export_chrome_trace(str(raw))
        with raw.open("rb") as source, gzip.open(trace, "wb") as target:
            shutil.copyfileobj(source, target)
        raw.unlink()
        out.append(f"trace in {trace}")


def workload_generator(model: torch.nn.Module, workload: Workload, plan: Batch) -> TorchGenerator:
    """A ``TorchGenerator`` on ``model`` with the workload's slots and room for its longest sequence."""
    longest = max(len(g.prompt) for g in plan) + workload.response[1] + 1
    slots = min(workload.slots, workload.groups * workload.size)
    return TorchGenerator(model, max_batch=slots, max_seq_len=longest)


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

    def __init__(self, objective: Any, plan: Batch, teacher: PackedScorer | None = None) -> None:
        self.objective, self.plan, self.teacher = objective, plan, teacher
        self.limiter = anyio.CapacityLimiter(1)  # one teacher forward at a time
        self.remaining: list[int] = []
        self.alone = ""  # the timeline of the last learner_alone run

    def begin(self) -> None:
        for p in self.objective.run.params:
            p.grad = None  # the previous batch's gradient stays until here (the 2-process check reads it)
        self.remaining = [len(group.trajectories) for group in self.plan]
        for g, group in enumerate(self.plan):
            self.objective.open_group(g, group.prompt)
        # The rollout starts every trajectory at once (its slots hold the batch), so the batch's
        # last group opens here, as the backward stage would tell the objective in a pipeline.
        all_opened = getattr(self.objective, "all_groups_opened", None)
        if callable(all_opened):
            all_opened()

    async def feed(self, finished: Finished) -> None:
        g, i, tokens = finished
        if self.teacher is None:
            self.objective.append_turn(g, i, tokens, [True] * len(tokens))
            self.objective.close_trajectory(g, i, self.plan[g].trajectories[i].reward)
        else:
            q = await anyio.to_thread.run_sync(
                TIMELINE.timed("teacher", teacher_logprobs),
                self.teacher,
                self.plan[g].prompt,
                tokens,
                limiter=self.limiter,
            )
            self.objective.append_turn(g, i, tokens, [True] * len(tokens), teacher_logprobs=q)
            self.objective.close_trajectory(g, i)
        self.remaining[g] -= 1
        if self.remaining[g] == 0:
            self.objective.close_group(g)

    def end(self) -> None:
        self.objective.assert_safe_to_step()
        _sync()


def teacher_logprobs(teacher: PackedScorer, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The teacher's log-prob of each response token (host fp64), as ``TransformersTeacher`` scores
    a Qwen3 model: one packed forward, replayed from CUDA graphs on a GPU."""
    (scores,) = teacher.logprobs([prompt + tokens], [len(tokens)])
    return torch.tensor(scores, dtype=torch.float64)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


async def learner_alone(learner: Learner, finished: list[Finished]) -> float:
    start = time.perf_counter()
    learner.begin()
    for item in finished:
        await learner.feed(item)
    learner.end()
    learner.alone = TIMELINE.busy(start, time.perf_counter())
    return time.perf_counter() - start


async def streamed(
    generator: TorchGenerator,
    learner: Learner,
    alone_step_ms: float,
    window: tuple[float, float] | None = None,
    trace: Path | None = None,
) -> tuple[float, float, str]:
    """(seconds of the whole step, seconds to the last trajectory, the timeline's summary) with the
    learner fed as they finish; ``window`` (offset, seconds): profile the device's streams then
    (and the host's ops into ``trace``)."""
    start = time.perf_counter()
    learner.begin()
    activity: list[str] = []
    async with anyio.create_task_group() as tasks:
        if window is not None:
            tasks.start_soon(gpu_window, *window, activity, trace)
        last, _ = await rollout(generator, learner.plan, learner.feed)
    learner.end()
    end = time.perf_counter()
    return end - start, last, "; ".join([TIMELINE.summary(start, start + last, end, alone_step_ms), *activity])


def dense_seconds(model: torch.nn.Module, plan: Batch, finished: list[Finished], teacher: PackedScorer | None) -> float:
    """The synchronous learner's time over the same tokens (teacher scoring included for OPD)."""
    tokens = {(g, i): t for g, i, t in finished}
    model.zero_grad(set_to_none=True)
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


def release_cache() -> None:
    """Give this process's cached device memory back to the driver, for a learner process to use."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Measured:
    """A row's own measurements: seconds of the learner alone, of the dense learner, of the
    streamed step and to its last trajectory, and the tokens generated."""

    row: str
    learner_s: float
    dense_s: float
    step_s: float
    last_s: float
    tokens: int

    def values(self, rollout_s: float) -> list[float]:
        """The run's value of each column after ``row`` (``COLUMNS[1:]``, percentages as fractions),
        against ``rollout_s``: the rollout alone (the mean of the runs around this run's round)."""
        learner_s, step_s, last_s = self.learner_s, self.step_s, self.last_s
        sync_s = rollout_s + learner_s
        return [
            rollout_s,
            learner_s,
            self.dense_s,
            sync_s,
            step_s,
            (sync_s - step_s) / learner_s,
            sync_s / step_s,
            last_s / rollout_s - 1,
            (last_s - rollout_s) / learner_s,
            sync_s / max(rollout_s, learner_s),
            step_s - last_s,
            (step_s - last_s) / learner_s,
            self.tokens / sync_s,
            self.tokens / step_s,
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
    "price",
    "ceiling",
    "tail s",
    "tail / learner",
    "sync tok/s",
    "streamed tok/s",
]
_PERCENT = {"hidden": "{:.0%}", "rollout slowdown": "{:+.1%}", "tail / learner": "{:.0%}"}  # the spread's columns too


def cells(name: str, runs: list[list[float]]) -> list[Any]:
    """A row of the table: ``name``, then each column's median over ``runs`` (one
    ``Measured.values`` list per run); the percentage columns (hidden, rollout slowdown,
    tail / learner) also give the runs' least and greatest value when there are several."""
    row: list[Any] = [name]
    for column, values in zip(COLUMNS[1:], zip(*runs, strict=True), strict=True):
        median = statistics.median(values)
        fmt = _PERCENT.get(column)
        if fmt is None:
            row.append(median)
        elif len(values) == 1:
            row.append(fmt.format(median))
        else:
            row.append(f"{fmt.format(median)} ({fmt.format(min(values))}..{fmt.format(max(values))})")
    return row


async def warmed_learner(
    row: str, model: torch.nn.Module, plan: Batch, finished: list[Finished], teacher: PackedScorer | None
) -> Learner:
    """The row's objective on a new ``StreamingRun``, warmed on the whole batch once (probes, the
    allocator, and the CUDA graphs of every row bucket the batch's packs need), so that the measured
    passes include no capture."""
    acceleration = Acceleration(learner_sms=_green_sms(row))
    objective = make_objective(row, thundersync.StreamingRun(model, acceleration=acceleration))
    await learner_alone(Learner(objective, plan, teacher), finished)
    return Learner(objective, plan, teacher)


async def measure_in_process(
    row: str,
    model: torch.nn.Module,
    generator: TorchGenerator,
    plan: Batch,
    finished: list[Finished],
    teacher: PackedScorer | None,
    alone_step_ms: float,
    window: tuple[float, float] | None,
    warm_streamed: bool,
    trace: Path | None,
) -> tuple[Measured, str]:
    """The row's measurements and its streamed run's timeline summary (``warm_streamed``: after one
    unmeasured streamed run, as in a training run's later steps)."""
    learner = await warmed_learner(row, model, plan, finished, teacher)
    dense_seconds(model, plan[:1], finished, teacher)  # the dense path's kernels and autotuning
    learner_s = await learner_alone(learner, finished)
    dense_s = dense_seconds(model, plan, finished, teacher)
    if row.endswith((_LEARNER_PROCESS, _SECOND_DEVICE)):
        release_cache()  # the learner process allocates from the driver, not from this process's cache
    if warm_streamed:  # packs formed beside a rollout (stream_early) may need buckets the warm-up did not capture
        await streamed(generator, learner, alone_step_ms)
    before = graph_counts()
    step_s, last_s, timeline = await streamed(generator, learner, alone_step_ms, window, trace)
    captured = {k: v - before.get(k, 0) for k, v in graph_counts().items() if "captured" in k and v > before.get(k, 0)}
    timeline += f"; captures during the measured streamed run: {captured or 'none'}"
    if isinstance(learner.objective, thundersync.LearnerProcess):
        learner.objective.close()
    tokens = sum(len(t) for _, _, t in finished)
    timeline = f"{row_name(row)}: {timeline} (learner alone: {learner.alone})"
    return Measured(row, learner_s, dense_s, step_s, last_s, tokens), timeline


async def measure_in_child(
    row: str,
    model: torch.nn.Module,
    generator: TorchGenerator,
    plan: Batch,
    finished: list[Finished],
    teacher: PackedScorer | None,
    tiny: bool,
) -> tuple[Measured, str]:
    """The row's measurements and its gradient check, the learner in a child of the row's own (its
    memory goes with it)."""
    release_cache()  # the child allocates from the driver, not from this process's cache
    child = ModelProcess(model, serve_learner, tiny, env=CHILD_ENV)
    try:
        child.send(ServeRow(row=row, plan=plan, finished=finished))
        learner_s = child.receive(Warmed).learner_s
        dense_seconds(model, plan[:1], finished, teacher)
        dense_s = dense_seconds(model, plan, finished, teacher)
        release_cache()  # the dense pass's cached blocks
        step_s, last_s, done = await streamed_in_child(generator, child, plan)
        check = await gradient_check(row, model, child, plan, done, teacher)
    finally:
        child.close()
    return Measured(row, learner_s, dense_s, step_s, last_s, sum(len(t) for _, _, t in finished)), check


async def streamed_in_child(
    generator: TorchGenerator, child: ModelProcess, plan: Batch
) -> tuple[float, float, list[Finished]]:
    """(seconds of the step, seconds to the last trajectory, the trajectories in finish order)."""

    async def feed(item: Finished) -> None:
        child.send(Feed(item=item))

    start = time.perf_counter()
    child.send(BeginBatch())
    last, done = await rollout(generator, plan, feed)
    child.send(EndBatch())
    child.receive(Ended)
    return time.perf_counter() - start, last, done


CHECKED = "model.norm.weight"  # the parameter whose gradient the 2-process rows compare element-wise


@dataclass(frozen=True)
class GradientDigest:
    """A gradient in brief: the norm of all of it and ``CHECKED``'s gradient (host floats)."""

    norm: float
    checked: list[float]

    @staticmethod
    def of(model: torch.nn.Module) -> GradientDigest:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        squares = sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads)
        checked = model.get_parameter(CHECKED).grad
        assert checked is not None, f"{CHECKED} has no gradient"
        return GradientDigest(math.sqrt(squares), checked.float().flatten().tolist())

    def errors(self, want: GradientDigest) -> tuple[float, float]:
        """(relative error of ``CHECKED``'s gradient, relative difference of the norms)."""
        got, ref = torch.tensor(self.checked, dtype=torch.float64), torch.tensor(want.checked, dtype=torch.float64)
        return float((got - ref).norm() / ref.norm()), abs(self.norm - want.norm) / want.norm


async def gradient_check(
    row: str, model: torch.nn.Module, child: ModelProcess, plan: Batch, done: list[Finished], teacher: Any
) -> str:
    """The child's streamed gradient against this process's over the same trajectories, same order."""
    child.send(SendGradient())
    got = child.receive(Gradient).digest
    await learner_alone(Learner(make_objective(row, thundersync.StreamingRun(model)), plan, teacher), done)
    want = GradientDigest.of(model)
    model.zero_grad(set_to_none=True)
    checked, norm = got.errors(want)
    return (
        f"{row_name(row)}: {CHECKED} rel. error {checked:.3g}; "
        f"gradient norm {got.norm:.6g} (child) vs {want.norm:.6g} (one process), rel. {norm:.3g}"
    )


class ServeRow(Message, frozen=True):
    """Make and warm the row's learner (OPD: the teacher once), time it alone over ``finished``;
    answered :class:`Warmed`."""

    row: str
    plan: Batch
    finished: list[Finished]


class BeginBatch(Message, frozen=True):
    """Stream a batch: the learner's ``begin()``."""


class Feed(Message, frozen=True):
    """A finished trajectory (group, index, tokens) for the learner."""

    item: Finished


class EndBatch(Message, frozen=True):
    """``assert_safe_to_step()``, synchronize; answered :class:`Ended`."""


class SendGradient(Message, frozen=True):
    """Answered :class:`Gradient`: the batch's :class:`GradientDigest`."""


class Warmed(Message, frozen=True):
    """The row's learner is warm; it took ``learner_s`` alone."""

    learner_s: float


class Ended(Message, frozen=True):
    """The batch's gradient is in the child's ``.grad``."""


class Gradient(Message, frozen=True):
    """The child's gradient, in brief."""

    digest: GradientDigest


async def serve_learner(model: torch.nn.Module, commands: Any, answers: Any, tiny: bool) -> None:
    """The learner process's loop over the parent's commands (each answered where it says) until
    :class:`~thundersync.engine.process.messages.Stop`."""
    teacher: PackedScorer | None = None
    learner: Learner | None = None
    while True:
        command = await anyio.to_thread.run_sync(commands.get)
        match command:
            case ServeRow(row=row, plan=plan, finished=finished):
                if _objective_kind(row) == "opd" and teacher is None:
                    parameter = next(model.parameters())
                    teacher = make_teacher(tiny, parameter.device, parameter.dtype)
                learner = await warmed_learner(
                    row, model, plan, finished, teacher if _objective_kind(row) == "opd" else None
                )
                answers.put(Warmed(learner_s=await learner_alone(learner, finished)))
            case Stop():
                return
            case SendGradient():
                answers.put(Gradient(digest=GradientDigest.of(model)))
            case BeginBatch() | Feed() | EndBatch() if learner is None:
                raise AssertionError(f"{command!r} before any row")
            case BeginBatch():
                learner.begin()
            case Feed(item=item):
                await learner.feed(item)
            case EndBatch():
                learner.end()
                answers.put(Ended())
            case _:
                raise AssertionError(f"unknown command {command!r}")


def workloads(tiny: bool, balanced: Workload | None = None) -> dict[str, Workload]:
    """The main and balanced workloads (``balanced``: in place of the built-in one)."""
    if tiny:
        shapes = {"main": Workload(2, 3, (12, 20), (4, 32)), "balanced": Workload(2, 3, (48, 64), (4, 12), 0.7, 0.5)}
    else:
        shapes = {
            "main": Workload(8, 8, (480, 544), (64, 2048)),
            "balanced": Workload(32, 8, (480, 544), (64, 1024), 1.2, 0.4, 256),
        }
    return shapes | ({"balanced": balanced} if balanced else {})


def parse_workload(text: str) -> Workload:
    """``G,S,PLO,PHI,RLO,RHI,MU,SIGMA,SLOTS`` (``--balanced``) as a ``Workload``."""
    try:
        g, s, plo, phi, rlo, rhi, mu, sigma, slots = text.split(",")
        return Workload(int(g), int(s), (int(plo), int(phi)), (int(rlo), int(rhi)), float(mu), float(sigma), int(slots))
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not GROUPS,SIZE,PROMPT_LO,PROMPT_HI,RESPONSE_LO,RESPONSE_HI,MU,SIGMA,SLOTS "
            f"(e.g. 24,8,480,544,64,1024,1.2,0.4,128): {err}"
        ) from None


def positive_int(text: str) -> int:
    """``--repeat``'s N: a whole number of runs, at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of runs (1 or more)")
    return int(text)


def parse_assignment(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` (``--child-env``) as (name, value)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


@dataclass
class Report:
    """What ``run_rows`` prints: the table's rows (medians), every run's own row, the 2-process
    rows' gradient checks, the in-process rows' timelines and the rollouts alone."""

    rows: list[list[Any]]
    runs: list[list[Any]]
    checks: list[str]
    timelines: list[str]
    notes: list[str]


async def run_rows(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> Report:
    """Each workload's rows, ``args.repeat`` rounds of all of them (row A, row B, ..., then again,
    so that drift meets every row alike), the rollout alone before the first round and after each."""
    shapes = workloads(args.tiny, args.balanced)
    report = Report([], [], [], [], [])
    teacher: PackedScorer | None = None
    for workload_name in ("main", "balanced"):
        wanted = [r for r in args.rows if _workload(r) == workload_name]
        if not wanted:
            continue
        workload = shapes[workload_name]
        plan = make_plan(workload, model.config.vocab_size, seed=0)
        generator = workload_generator(model, workload, plan)
        await rollout(generator, plan)  # warm-up: decode graphs for every key length, kernels, allocator
        alone_start = time.perf_counter()
        rollout_s, finished = await rollout(generator, plan)
        alone_step_ms = TIMELINE.median_step_ms(alone_start, time.perf_counter())
        print(f"[done] {workload_name} rollout alone: {rollout_s:.2f} s", file=sys.stderr, flush=True)
        alone = [rollout_s]
        runs: dict[str, list[list[float]]] = {row: [] for row in wanted}
        for round_ in range(1, args.repeat + 1):
            measured: list[Measured] = []
            for row in wanted:
                if _objective_kind(row) == "opd" and teacher is None:
                    teacher = make_teacher(args.tiny, device, next(model.parameters()).dtype)
                row_teacher = teacher if _objective_kind(row) == "opd" else None
                label = f"run {round_}/{args.repeat}, " if args.repeat > 1 else ""
                measured.append(
                    await measure_row(
                        args, row, model, generator, plan, finished, row_teacher, alone_step_ms, label, report
                    )
                )
                line = markdown_table(COLUMNS, [cells(row_name(row), [measured[-1].values(rollout_s)])])
                print(
                    f"[done] ({label}against the first rollout alone) {line.splitlines()[-1]}",
                    file=sys.stderr,
                    flush=True,
                )
            # The rollout alone once more: its time moves by several percent from run to run, and the
            # table's slowdown, price and hidden columns are differences against it.
            again_s, _ = await rollout(generator, plan)
            alone.append(again_s)
            for result in measured:
                runs[result.row].append(result.values((alone[-2] + alone[-1]) / 2))
        report.notes.append(
            f"{workload_name}: rollout alone {alone[0]:.3f} s before its rows and "
            f"{', '.join(f'{s:.3f}' for s in alone[1:])} s after each round of them; "
            "a run's columns use the mean of the two around its round"
        )
        report.rows.extend(cells(row_name(row), runs[row]) for row in wanted)
        report.runs.extend(
            [row_name(row), i, *cells("", [run])[1:]] for row in wanted for i, run in enumerate(runs[row], 1)
        )
    return report


async def measure_row(
    args: argparse.Namespace,
    row: str,
    model: torch.nn.Module,
    generator: TorchGenerator,
    plan: Batch,
    finished: list[Finished],
    teacher: PackedScorer | None,
    alone_step_ms: float,
    label: str,
    report: Report,
) -> Measured:
    """One run of ``row`` (its gradient check or timeline into ``report``, after ``label``)."""
    if row.endswith(_IN_CHILD):
        result, check = await measure_in_child(row, model, generator, plan, finished, teacher, args.tiny)
        report.checks.append(label + check)
        print(f"[check] {label}{check}", file=sys.stderr, flush=True)
        return result
    if _decode_apart(row):
        generator = await apart_generator(row, model, generator, plan, report)
    suffix = row[row.rfind("-") :]
    layers = {_EAGER: "eager", _COMPILED: "compiled-graphs", _UNFUSED: "unfused-graphs"}.get(suffix, "graphs")
    with engine_layers(layers):
        result, timeline = await measure_in_process(
            row,
            model,
            generator,
            plan,
            finished,
            teacher,
            alone_step_ms,
            args.gpu_window,
            args.warm_streamed,
            args.trace / f"{row}.json.gz" if args.trace else None,
        )
    report.timelines.append(label + timeline)
    release_engine_graphs(model)  # the next row captures its own (rows may differ in layer math)
    print(f"[timeline] {label}{timeline}", file=sys.stderr, flush=True)
    return result


CHILD_ENV: dict[str, str] = {}  # --child-env: the learner processes' extra environment
_IN_CHILD = "-2proc"
_EAGER = "-eager"  # the engine's layers eager (no CUDA graphs), in this process
_COMPILED = "-compiled"  # whole-pack graphs of the compiled layers (THUNDERSYNC_ENGINE_COMPILE=on), in this process
_UNFUSED = "-unfused"  # whole-pack graphs of the eager layer math (THUNDERSYNC_ENGINE_FUSED=off), in this process
_LEARNER_PROCESS = "-proc"  # the objective a thundersync.LearnerProcess, the teacher in this process
_SECOND_DEVICE = "-gpu2"  # a LearnerProcess on cuda:1, its own copy of the parameters (CPU: a private copy)


# in-process rows: the learner on a green context of N SMs; -greenNd: the decode on the other SMs too
_GREEN = re.compile(r"-green([0-9]+)(d?)$")


def _green_sms(row: str) -> int:
    """The SMs of the row's learner partition (0: none)."""
    match = _GREEN.search(row)
    return int(match.group(1)) if match else 0


def _decode_apart(row: str) -> bool:
    """Whether the row's decode runs on the SMs its learner's partition leaves (``-greenNd``)."""
    match = _GREEN.search(row)
    return bool(match and match.group(2))


def row_name(row: str) -> str:
    """The row's name in the table."""
    sms = _green_sms(row)
    base = _ROW_NAMES[_GREEN.sub("", row)]
    if not sms:
        return base
    return f"{base}, learner on {sms} SMs (green context)" + (", decode on the others" if _decode_apart(row) else "")


async def apart_generator(
    row: str, model: torch.nn.Module, like: TorchGenerator, plan: Batch, report: Report
) -> TorchGenerator:
    """A generator like ``like`` whose decode runs on the SMs the row's learner partition leaves
    (``decode_partition``), warmed up (its graphs captured there); its rollout alone in the report."""
    acceleration = Acceleration(learner_sms=_green_sms(row), decode_partition="on")
    generator = TorchGenerator(
        model, max_batch=like.config.max_batch, max_seq_len=like.max_seq_len, acceleration=acceleration
    )
    await rollout(generator, plan)
    alone_s, _ = await rollout(generator, plan)
    report.notes.append(f"{row}: the rollout alone with the decode on the other SMs: {alone_s:.3f} s")
    print(f"[done] {row}: rollout alone on the decode's partition: {alone_s:.2f} s", file=sys.stderr, flush=True)
    return generator


def _objective_kind(row: str) -> str:
    row = _GREEN.sub("", row)
    for suffix in (_IN_CHILD, _EAGER, _COMPILED, _UNFUSED, _LEARNER_PROCESS, _SECOND_DEVICE):
        row = row.removesuffix(suffix)
    return row


def _workload(row: str) -> str:
    return "balanced" if _objective_kind(row) == "balanced" else "main"


def make_objective(row: str, run: thundersync.StreamingRun) -> Any:
    kind = _objective_kind(row)
    if kind == "opd":
        build: Any = thundersync.OPDStream
    else:
        pack_tokens = {"grpo-pack0": 0, "grpo-pack2048": 2048, "grpo-early": 8192}.get(kind)  # None: by placement
        build = functools.partial(
            thundersync.RewardLinearBackward,
            pack_tokens=pack_tokens,
            stream_early=kind == "grpo-early",
            tail_groups=2 if kind == "grpo-tail2" else 0,
        )
    if row.endswith(_SECOND_DEVICE):
        if kind != "opd" and build.keywords["pack_tokens"] is None:  # its own GPU, as the grpo factory decides
            build = functools.partial(build, pack_tokens=default_pack_tokens(run, own_device=True))
        device = "cuda:1" if run.layout.device.type == "cuda" else "cpu"
        return thundersync.LearnerProcess(run, build, env=CHILD_ENV, device=device)
    if not row.endswith(_LEARNER_PROCESS):
        return build(run)
    release_cache()  # the child allocates from the driver, not from this process's cache
    return thundersync.LearnerProcess(run, build, env=CHILD_ENV)


def make_teacher(tiny: bool, device: torch.device, dtype: torch.dtype) -> PackedScorer:
    """The scorer of a second model of the student's shape (other weights), frozen; the same in
    every process."""
    teacher = make_model(tiny, device, dtype).requires_grad_(False)
    generator = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=generator, device=device, dtype=p.dtype), alpha=0.02)
    return PackedScorer(teacher)


_ROW_NAMES = {
    "grpo": "GRPO, default packing (pack_tokens by placement)",
    "grpo-tail2": "GRPO, default packing, tail_groups=2",
    "grpo-early": "GRPO, pack_tokens=8192, stream_early=True",
    "grpo-pack0": "GRPO, pack_tokens=0",
    "grpo-pack2048": "GRPO, pack_tokens=2048 (packs the whole-pack graphs hold)",
    "opd": "OPD (teacher on the same device)",
    "balanced": "balanced GRPO (learner ~ rollout)",
    "grpo-eager": "GRPO, default packing, eager (no graphs)",
    "opd-eager": "OPD, eager (no graphs)",
    "opd-compiled": "OPD, pack graphs of the compiled layers",
    "grpo-unfused": "GRPO, pack graphs of the eager layer math (THUNDERSYNC_ENGINE_FUSED=off)",
    "opd-unfused": "OPD, pack graphs of the eager layer math (THUNDERSYNC_ENGINE_FUSED=off)",
    "grpo-compiled": "GRPO, pack graphs of the compiled layers",
    "grpo-early-compiled": "GRPO, stream_early=True, pack graphs of the compiled layers",
    "balanced-eager": "balanced GRPO, eager (no graphs)",
    "grpo-2proc": "GRPO, learner in a 2nd process",
    "grpo-proc": "GRPO, LearnerProcess",
    "grpo-early-proc": "GRPO, stream_early=True, LearnerProcess",
    "balanced-proc": "balanced GRPO, LearnerProcess",
    "grpo-gpu2": "GRPO, LearnerProcess on a second GPU",
    "opd-gpu2": "OPD, LearnerProcess on a second GPU (teacher in this process)",
    "balanced-gpu2": "balanced GRPO, LearnerProcess on a second GPU",
    "opd-proc": "OPD, LearnerProcess (teacher in this process)",
    "opd-2proc": "OPD, learner and teacher in a 2nd process",
    "balanced-2proc": "balanced GRPO, learner in a 2nd process",
}


def check_green_rows(parser: argparse.ArgumentParser, rows: list[str], cuda: bool) -> None:
    """Refuse -greenN rows that cannot run here: N not a multiple of 8, a row in another process,
    or no green context on this machine (the library's own message says what is missing)."""
    green = [row for row in rows if _green_sms(row)]
    if not green:
        return
    for row in green:
        if _GREEN.sub("", row).endswith((_IN_CHILD, _LEARNER_PROCESS, _SECOND_DEVICE)):
            parser.error(
                f"row {row}: -greenN places this process's engine; the learner of this row is in another process"
            )
        if _green_sms(row) % 8:
            parser.error(f"row {row}: a green context's SMs are a multiple of 8 on Hopper, got {_green_sms(row)}")
    from thundersync._green import missing

    lacking = missing(torch.device("cuda" if cuda else "cpu"))
    if lacking is not None:
        parser.error(f"row(s) {', '.join(green)} need a CUDA green context, but {lacking}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and batch on CPU (seconds)")
    parser.add_argument(
        "--rows",
        default="grpo,grpo-tail2,grpo-early,opd,grpo-pack0,balanced",
        help=f"comma-separated, of {', '.join(_ROW_NAMES)}",
    )
    parser.add_argument(
        "--learner-sms",
        default="",
        metavar="N,N,...",
        help="add a grpo-greenN row for each N: the learner's streams and graphs on a green context of N SMs "
        "(a multiple of 8); any in-process row takes the suffix -greenN",
    )
    parser.add_argument(
        "--balanced",
        type=parse_workload,
        default=None,
        metavar="G,S,PLO,PHI,RLO,RHI,MU,SIGMA,SLOTS",
        help="the balanced rows' workload instead of the built-in one",
    )
    parser.add_argument(
        "--child-env",
        type=parse_assignment,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in the environment of the learner processes of the -proc and -2proc rows, e.g. "
        "CUDA_MPS_CLIENT_PRIORITY=1 under an MPS daemon; repeatable",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval(S) first: how long a thread may hold the GIL while another waits (Python's default 0.005)",
    )
    parser.add_argument(
        "--gpu-window",
        type=float,
        nargs=2,
        metavar=("OFFSET", "SECONDS"),
        default=None,
        help="profile each in-process streamed run's CUDA streams from OFFSET for SECONDS (kernels, busy time, overlap)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="with --gpu-window: also record every thread's host ops, one gzipped Chrome trace per row in this folder",
    )
    parser.add_argument(
        "--cold-streamed",
        dest="warm_streamed",
        action="store_false",
        help="measure the first streamed run (default: the second; the first may capture CUDA graphs for its packs)",
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        metavar="N",
        help="measure each row N times, in rounds of all the rows; each cell is the median of the N runs",
    )
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    args.rows = args.rows.split(",") + [f"grpo-green{n}" for n in filter(None, args.learner_sms.split(","))]
    if args.trace is not None:
        if args.gpu_window is None:
            parser.error("--trace records the --gpu-window: give both")
        args.trace.mkdir(parents=True, exist_ok=True)
    unknown = [row for row in args.rows if _GREEN.sub("", row) not in _ROW_NAMES]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; the rows are {', '.join(_ROW_NAMES)} (and -greenN of each)")
    cuda = torch.cuda.is_available() and not args.tiny
    check_green_rows(parser, args.rows, cuda)
    second = [row for row in args.rows if row.endswith(_SECOND_DEVICE)]
    if cuda and second and torch.cuda.device_count() < 2:
        parser.error(
            f"row(s) {', '.join(second)} need a second CUDA device; this machine has {torch.cuda.device_count()}"
        )
    device = torch.device("cuda" if cuda else "cpu")
    model = make_model(args.tiny, device, torch.bfloat16 if cuda else torch.float32)
    CHILD_ENV.update(args.child_env)
    TIMELINE.install()
    report = anyio.run(run_rows, args, model, device)
    print(header(" ".join(["python", *sys.argv])))
    shapes = workloads(args.tiny, args.balanced)
    print(f"workload: {shapes['main']}; balanced: {shapes['balanced']}; dtype {next(model.parameters()).dtype}")
    print(
        f"GIL switch interval {sys.getswitchinterval()} s; learner processes' extra environment: {[f'{k}={v}' for k, v in CHILD_ENV.items()]}\n"
    )
    if args.repeat > 1:
        print(
            f"each cell is the median of {args.repeat} runs of its row (rounds of all the rows, interleaved); "
            "hidden, rollout slowdown and tail / learner also give the runs' least..greatest\n"
        )
    print(markdown_table(COLUMNS, report.rows))
    if args.repeat > 1:
        print("\neach run:\n")
        print(markdown_table(["row", "run", *COLUMNS[1:]], report.runs))
    print("\n" + "\n".join(report.notes))
    if cuda:
        print(f"\nengine graphs in this process (all rows): {graph_counts()}")
    if report.timelines:
        print("\nhost time of the streamed runs (in-process rows), during the rollout and after its last trajectory:")
        print("\n".join(f"- {line}" for line in report.timelines))
    if report.checks:
        print("\ngradient check, the learner process's streamed gradient against one process's:")
        print("\n".join(f"- {check}" for check in report.checks))


if __name__ == "__main__":
    main()
