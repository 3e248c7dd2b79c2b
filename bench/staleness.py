"""Bounded staleness on the agent example: ``max_staleness`` = 0, 1, 2 side by side.

    python bench/staleness.py              # 8 steps of each after the file's warm-up (a few minutes on 2 CPU cores)
    python bench/staleness.py --tiny       # 2 steps of each, a shorter warm-up (checks the script)

Builds ``examples/agent_grpo.toml`` in process (the supervised warm-up, then GRPO with the
calculator tool on the ``local`` sandbox backend), once per ``max_staleness``, with the same seeds,
and runs its graph. Per configuration: the median and mean ``step_s`` (time between StepDone
events; the first step counts from the graph's start), the graph's wall time, the generator's idle
time (wall time from the first generation request to the last step during which no request was in
flight, measured by a wrapper around the torch-generator), the mean ``version_lag_mean`` of the
steps, and the reward of the last step and the mean over all steps. One run each: the reward of a
run is noisy, and CPU timings on a shared machine are not results (bench/RESULTS.md takes numbers
measured on an idle machine only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import header, markdown_table
from thundersync.app.files.build import build_graph, build_objects
from thundersync.app.files.definition import load
from thundersync.app.metrics.step_metrics import StepMetrics, watched
from thundersync.events import EventBase
from thundersync.generation.base import GenerationRequest, GenerationResult
from thundersync.pipeline import run_graph

FILE = Path(__file__).resolve().parent.parent / "examples" / "agent_grpo.toml"


class Busy:
    """A generator wrapper that measures the time with at least one request in flight."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.in_flight = 0
        self.busy_s = 0.0
        self.first: float | None = None
        self._since = 0.0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        now = time.perf_counter()
        self.first = now if self.first is None else self.first
        if self.in_flight == 0:
            self._since = now
        self.in_flight += 1
        try:
            return await self.inner.generate(request)  # type: ignore[no-any-return]
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy_s += time.perf_counter() - self._since

    def allow_weight_changes(self) -> None:
        self.inner.allow_weight_changes()

    def __getattr__(self, name: str) -> Any:  # max_seq_len, rng states...
        return getattr(self.inner, name)


def one_run(directory: Path, k: int, steps: int, warmup_steps: int | None) -> dict[str, Any]:
    """Build and run the file with ``max_staleness = k``; its step records and timings."""
    sets = [
        f"objects.policy.max_staleness={k}",
        f"run.steps={steps}",
        f'objects.checkpointer.directory="{directory / f"ckpt{k}"}"',
        'run.progress="off"',
    ]
    if warmup_steps is not None:
        sets.append(f"objects.model.steps={warmup_steps}")
    spec = load(FILE, sets)
    objects = build_objects(spec)
    busy = objects["generator"] = Busy(objects["generator"])
    graph = build_graph(spec, **objects)
    metrics, records, done_at = StepMetrics(), [], []

    def see(event: EventBase) -> None:
        record = metrics.observe(event)
        if record is not None:
            records.append(record)
            done_at.append(time.perf_counter())

    start = time.perf_counter()
    anyio.run(run_graph, watched(graph, see))
    end = time.perf_counter()
    active = end - (busy.first if busy.first is not None else start)
    return {"records": records, "wall_s": end - start, "idle_s": active - busy.busy_s}


def row(k: int, run: dict[str, Any]) -> list[Any]:
    steps = run["records"]
    step_s = [r["step_s"] for r in steps]
    rewards = [r["reward_mean"] for r in steps if r["reward_mean"] is not None]
    lags = [r["version_lag_mean"] for r in steps if r["version_lag_mean"] is not None]
    return [
        k,
        len(steps),
        f"{statistics.median(step_s):.2f}",
        f"{statistics.fmean(step_s):.2f}",
        f"{run['wall_s']:.1f}",
        f"{run['idle_s']:.1f}",
        f"{statistics.fmean(lags):.2f}" if lags else "-",
        f"{rewards[-1]:.3f}" if rewards else "-",
        f"{statistics.fmean(rewards):.3f}" if rewards else "-",
    ]


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warmup-steps", type=int, default=None, help="the warm-up's steps (default: the file's)")
    parser.add_argument("--tiny", action="store_true", help="2 steps each after a 5-step warm-up")
    args = parser.parse_args()
    steps, warmup = (2, 5) if args.tiny else (args.steps, args.warmup_steps)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.staleness:
            rows.append(row(k, one_run(Path(tmp), k, steps, warmup)))
    print(header(" ".join(["python", "bench/staleness.py", *sys.argv[1:]])))
    columns = [
        "max_staleness",
        "steps",
        "step s (median)",
        "step s (mean)",
        "wall s",
        "generator idle s",
        "version lag (mean)",
        "reward (last step)",
        "reward (mean)",
    ]
    print(markdown_table(columns, rows))


if __name__ == "__main__":
    main_bench()
