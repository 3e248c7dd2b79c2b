"""Agent episodes per second against sandbox slots, per backend, and where an episode's time goes.

    python bench/agent_env.py --backends docker udocker --slots 1 2 4 8 --episodes 32
    python bench/agent_env.py --tiny        # the local backend, a few episodes: a smoke run

Each episode is one trajectory of a generated repository task (``repo-bug-tasks``, as in
examples/agent_repo.toml) through the real graph: source -> generate -> tool-execute (the
``sandbox-tools`` runner: one sandbox per trajectory, from a warm pool) -> reward (``task-grader``:
the task's test, run in the trajectory's own sandbox) -> close (gives the sandbox back: reset,
verified). The generator is scripted: it writes a correct episode (view the test, run it with
the ``shell`` tool, replace the bug, submit), taking ``--token-ms`` per generated token of wall time, the stand-in for a policy
model's decoding; the sandboxes, tools and grading are real. ``slots`` trajectories run at once
(generate's concurrency, the admission's sandbox slots, the pool's size, all ``warm``).

Per row: episodes/s; the mean share of an episode's wall time (first request to grade) spent
generating, in tool calls and grading (the rest is waiting for a slot, resets of others, the
event loop), with the tool calls' mean wall time per episode; and, from the pool, the mean time to take a sandbox (warm: an idle one is handed
over) and to reset one, and the machine's load average after the row. The target it checks: tool execution <= 10% of an episode's wall time at
8 concurrent trajectories on Docker with a warm pool.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any, Literal

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import header, markdown_table
from thundersync.events import ActionGenerated
from thundersync.generation.base import GenerationRequest, GenerationResult
from thundersync.pipeline import Graph, run_graph
from thundersync.sandboxes import NotIsolatedWarning
from thundersync.scheduling import Admission
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.tasks import RepoBugTasks, TaskGrader
from thundersync.tasks.repo_tasks import call
from thundersync.tools import ByteTokenizer, Qwen3ToolCallParser, SandboxToolRunner, ToolResult, sandbox_tools

TOKENS = ByteTokenizer()
Key = tuple[Hashable, Hashable]


class Solver:
    """Writes each task's correct episode, ``token_s`` of wall time per token (turn = session's count)."""

    def __init__(self, fixes: Mapping[str, tuple[str, str]], token_s: float) -> None:
        self.fixes, self.token_s = fixes, token_s
        self.turns: dict[Any, int] = defaultdict(int)
        self.spent: dict[Any, float] = defaultdict(float)
        self.started: dict[Any, float] = {}

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        session = request.session_id
        self.started.setdefault(session, time.perf_counter())
        prompt = TOKENS.decode(request.prompt_ids)
        bug, fix = next(ops for text, ops in self.fixes.items() if prompt.startswith(text))
        replies = [
            call("view", {"path": "test_ops.py"}),
            call("shell", {"command": "python3 -B test_ops.py"}),
            call("replace", {"path": "ops.py", "old": f"a {bug} b", "new": f"a {fix} b"}),
            call("submit", {}),
        ]
        text = replies[min(self.turns[session], 3)]
        self.turns[session] += 1
        tokens = TOKENS.encode(text)
        start = time.perf_counter()
        await anyio.sleep(self.token_s * len(tokens))
        self.spent[session] += time.perf_counter() - start
        return GenerationResult(token_ids=tokens, logprobs=[-1.0] * len(tokens), finish_reason="stop", prompt_len=0)


class TimedRunner:
    """The runner, with the wall time of each trajectory's tool calls recorded."""

    def __init__(self, runner: SandboxToolRunner) -> None:
        self.runner, self.spent = runner, defaultdict(float)

    async def __aenter__(self) -> TimedRunner:
        await self.runner.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.__aexit__(*exc)

    async def run(self, action: ActionGenerated) -> ToolResult:
        return await self.run_turn(action, {})

    async def run_turn(self, action: ActionGenerated, task: Mapping[str, Any]) -> ToolResult:
        start = time.perf_counter()
        try:
            return await self.runner.run_turn(action, task)
        finally:
            self.spent[(action.group_id, action.trajectory_id)] += time.perf_counter() - start

    async def trajectory_ended(self, group_id: Hashable, trajectory_id: Hashable) -> None:
        await self.runner.trajectory_ended(group_id, trajectory_id)

    async def trajectory_closed(self, group_id: Hashable, trajectory_id: Hashable) -> None:
        await self.runner.trajectory_closed(group_id, trajectory_id)

    def use_slots(self, slots: Any) -> None:
        self.runner.use_slots(slots)

    def release_at(self, when: Literal["end", "close"]) -> None:
        self.runner.release_at(when)


class TimedGrader(TaskGrader):
    """The task grader, with each trajectory's grading time and end recorded."""

    spent: dict[Key, float]
    ended: dict[Key, float]

    async def score_trajectory(self, group_id: Any, trajectory_id: Any, *args: Any) -> float:
        start = time.perf_counter()
        try:
            return await super().score_trajectory(group_id, trajectory_id, *args)
        finally:
            self.ended[(group_id, trajectory_id)] = time.perf_counter()
            self.spent[(group_id, trajectory_id)] = self.ended[(group_id, trajectory_id)] - start


def episode_graph(tasks: RepoBugTasks, solver: Solver, runner: TimedRunner, grader: TimedGrader, slots: int) -> Graph:
    """source -> generate -> tool-execute -> reward -> close, ``slots`` trajectories at once."""
    admission = Admission(sandbox_slots=slots)
    generate = GenerateStage(
        GenerateStage.Config(turns=5, max_new_tokens=128, concurrency=slots),
        generator=solver,
        tool_calls=Qwen3ToolCallParser(),
    )
    tools = ToolExecuteStage(ToolExecuteStage.Config(concurrency=slots), tools=runner, admission=admission)  # type: ignore[arg-type]
    return (
        Graph()
        .add("source", SourceStage(SourceStage.Config(samples=1), tasks=tasks, admission=admission))
        .add("generate", generate, reads=["source"], feedback=["tool-execute"])
        .add("tool-execute", tools, reads=["generate"])
        .add(
            "reward",
            RewardStage(RewardStage.Config(concurrency=slots), scorer=grader),
            reads=["generate", "tool-execute"],
        )
        .add("close", CloseStage(tools=runner, admission=admission), reads=["generate", "reward"], output=True)  # type: ignore[arg-type]
    )


async def measure(backend: str, image: str | None, slots: int, episodes: int, token_s: float) -> list[Any]:
    """One row of the table: ``episodes`` episodes over ``slots`` warm sandboxes of ``backend``."""
    tasks = RepoBugTasks(count=episodes, seed=0)
    solver = Solver({TOKENS.decode(t.prompt_ids): (t.fields["bug"], t.fields["fix"]) for t in tasks.tasks()}, token_s)
    raw = sandbox_tools(
        backend=backend,  # type: ignore[arg-type]
        image=image,
        tools=("view", "replace", "shell", "submit"),
        max_sandboxes=slots,
        warm=slots,
        allow_unsafe_local_sandbox=backend == "local",
    )
    runner, grader = TimedRunner(raw), TimedGrader(tools=raw)
    grader.spent, grader.ended = {}, {}
    graph = episode_graph(tasks, solver, runner, grader, slots)
    async with raw:  # the warm pool starts before the clock
        before = raw.sessions.pools.stats
        start = time.perf_counter()
        await run_graph(graph)
        wall = time.perf_counter() - start
        pool = raw.sessions.pools.stats
    keys = [(group_id, 0) for group_id in range(episodes)]
    episode = {k: grader.ended[k] - solver.started[f"{k[0]!r}/0"] for k in keys}
    mean = {
        "gen": statistics.fmean(solver.spent[f"{k[0]!r}/0"] / episode[k] for k in keys),
        "tool": statistics.fmean(runner.spent[k] / episode[k] for k in keys),
        "grade": statistics.fmean(grader.spent[k] / episode[k] for k in keys),
    }
    take_ms = 1000 * (pool.take_s - before.take_s) / max(pool.takes - before.takes, 1)
    reset_ms = 1000 * pool.reset_s / max(pool.resets, 1)
    tool_ms = 1000 * statistics.fmean(runner.spent[k] for k in keys)
    row = [backend, slots, episodes / wall, statistics.fmean(episode.values())]
    row += [100 * mean["gen"], 100 * mean["tool"], tool_ms, 100 * mean["grade"], take_ms, reset_ms]
    return [*row, pool.created, os.getloadavg()[0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["docker", "udocker"])
    parser.add_argument("--image", default="thundersync-agent/python:1")
    parser.add_argument("--slots", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--token-ms", type=float, default=5.0, help="generation wall time per token (ms)")
    parser.add_argument("--tiny", action="store_true", help="local backend, 2 and 4 slots, 8 episodes")
    args = parser.parse_args()
    if args.tiny:
        args.backends, args.slots, args.episodes = ["local"], [2, 4], 8
    warnings.simplefilter("ignore", NotIsolatedWarning)
    print(header("python bench/agent_env.py " + " ".join(sys.argv[1:])))
    rows = []
    for backend in args.backends:
        for slots in args.slots:
            image = None if backend == "local" else args.image
            rows.append(anyio.run(measure, backend, image, slots, args.episodes, args.token_ms / 1000))
    columns = [
        "backend",
        "slots",
        "episodes/s",
        "episode s",
        "generation %",
        "tool calls %",
        "tool ms / episode",
        "grading %",
        "take ms (warm)",
        "reset ms",
        "sandboxes made",
        "load average",
    ]
    print(markdown_table(columns, rows))
    at8 = [row for row in rows if row[0] == "docker" and row[1] == 8]
    if at8:
        share = at8[0][5]
        met = "met" if share <= 10 else "NOT met"
        print(f"\ntarget (tool calls <= 10% of an episode at 8 slots on docker, warm pool): {met} ({share:.1f}%)")


if __name__ == "__main__":
    main()
