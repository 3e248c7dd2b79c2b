"""Bounded staleness against zero staleness: the same pipeline file run with ``max_staleness = k``.

    python bench/staleness.py                                   # examples/agent_grpo.toml, k = 0 1 2, on CPU
    python bench/staleness.py --k 0 1 --steps 12 --plot docs/staleness.png -- --set run.device=cuda
    python bench/staleness.py --long-tail --k 0 1 2             # the long-tail agent workload (below)

Each k is a separate ``thundersync run`` of the file (same seeds, so the same warm-up and the same
prompts), its metrics file read back. One table, side by side:

- ``wall s after step 1``: the sum of the later steps' ``step_s``. Step 1 is left out of it and of
  every time below: it holds the first batch's whole rollout, which no k can overlap, and the
  compiles, which a later run of the same call finds in the compile cache on disk (on the H200,
  step 1 took 24 s in a call's first run and 7-15 s in the next two);
- ``step s``: the median ``step_s`` after the first step, and its ratio to k = 0; ``mean step s``:
  the wall time after step 1 over the steps it holds, and its ratio to k = 0. At k >= 1 the steps
  can alternate short and long (a batch that finished while the step before it ran steps at once),
  so the median can flatter a k whose wall time is no shorter: the mean is the throughput;
- ``rollout s`` / ``learn s``: medians of the steps' ``rollout_s`` and ``learn_s``;
- ``generator idle s``: the median of ``generator_idle_s`` when the run reports it;
- ``traj tokens p50 / max``: medians over the steps of ``trajectory_tokens_median`` and
  ``trajectory_tokens_max`` (the batch's typical and longest trajectory, in action tokens);
- ``lag mean`` / ``lag max``: the batch's version lag (``version_lag_mean`` / ``version_lag_max``);
- ``reward (last N)``: the mean ``reward_mean`` of the last ``--last`` steps; ``reward at T``: the
  mean ``reward_mean`` of the steps finished within the wall time ``T`` (after step 1) that every k
  reached (the shortest run's), so a faster k is credited with the extra steps it fit.

The first k given is the baseline of the ratio column. ``--warmup-cache DIR`` gives the file's
``supervised-warmup`` a cache, so that the runs after the first load its warm-up (and every k starts
from the same warmed-up weights, on the GPU too).

``--long-tail`` runs the agent example as a long-tail agent workload: its warm-up episodes open
with a thinking block that restates the expression a lognormal number of times (median 4, sigma 1,
at most 40: ``think_repeats`` of :class:`~thundersync.tasks.CalculatorDemonstrations`), so the
warmed-up policy's first actions run from about 100 to over 500 tokens and each batch waits for
its few longest trajectories; the per-turn token budget and the context grow to fit (the settings
are ``LONG_TAIL`` below, given before the arguments after ``--``).

``--plot`` draws reward against step and against wall time, one line per k (matplotlib, the
``plot`` extra). ``--keep DIR`` keeps each run's metrics file as ``DIR/k<K>.jsonl``; ``--kept DIR``
runs nothing and prints the table (and plot) of those files. Arguments after ``--`` go to every
``thundersync run`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import header, markdown_table

ROOT = Path(__file__).resolve().parents[1]

LONG_TAIL = [
    "--set", "objects.demonstrations.think_repeats=4", "--set", "objects.demonstrations.think_sigma=1.0",
    "--set", "objects.demonstrations.think_max=40",
    "--set", "stages.generate.max_new_tokens=544",  # 40 restatements (410 tokens), the call (88) and room
    "--set", "objects.generator.max_seq_len=1024", "--set", "objects.base_model.config.max_position_embeddings=1024",
]  # fmt: skip


def run_once(file: Path, k: int, args: argparse.Namespace, extra: list[str], scratch: Path) -> list[dict[str, Any]]:
    """One ``thundersync run`` with ``max_staleness = k`` in a directory of its own (its checkpoints
    and metrics); its step records, with ``wall_s`` added."""
    scratch = Path(tempfile.mkdtemp(prefix=f"k{k}-", dir=scratch))
    (scratch / "examples").symlink_to(ROOT / "examples")  # files name their data relative to the working directory
    metrics = scratch / "metrics.jsonl"
    command = [
        sys.executable, "-m", "thundersync", "run", str(file), "--no-progress",
        "--set", f"run.metrics={metrics}", "--set", f"run.steps={args.steps}",
        "--set", f"{args.key}={k}", *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(
        command,
        cwd=scratch,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"k = {k}: `{' '.join(command)}` exited with {done.returncode}")
    print(f"k = {k}: {time.perf_counter() - started:.1f} s in all", file=sys.stderr)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(metrics, args.keep / f"k{k}.jsonl")
    return read_steps(metrics)


def read_steps(metrics: Path) -> list[dict[str, Any]]:
    """The step records of a metrics file, each with ``wall_s``: the seconds since the end of step 1
    (the sum of the later steps' ``step_s``; step 1 is at 0)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("event") == "step"]
    wall = 0.0
    for index, record in enumerate(steps):
        wall += float(record["step_s"]) if index else 0.0
        record["wall_s"] = wall
    return steps


def _median(steps: list[dict[str, Any]], key: str) -> float | None:
    values = [float(s[key]) for s in steps if s.get(key) is not None]
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(runs: list[tuple[int, list[dict[str, Any]]]], last: int) -> str:
    """The side-by-side table of the runs (first k is the baseline of the ratio)."""
    horizon = min(steps[-1]["wall_s"] for _, steps in runs)
    base = None
    rows = []
    for k, steps in runs:
        later = steps[1:] or steps
        step_s = _median(later, "step_s")
        mean_s = steps[-1]["wall_s"] / (len(steps) - 1) if len(steps) > 1 else None
        base = (step_s, mean_s) if base is None else base
        rewards = [float(s["reward_mean"]) for s in steps if s.get("reward_mean") is not None]
        in_time = [
            float(s["reward_mean"]) for s in steps if s["wall_s"] <= horizon and s.get("reward_mean") is not None
        ]
        lags = [float(s["version_lag_max"]) for s in steps if s.get("version_lag_max") is not None]
        rows.append([
            k, len(steps), round(steps[-1]["wall_s"], 1), step_s,
            (step_s / base[0]) if step_s is not None and base[0] else None,
            mean_s, (mean_s / base[1]) if mean_s is not None and base[1] else None,
            _median(later, "rollout_s"), _median(later, "learn_s"), _median(later, "generator_idle_s"),
            _median(steps, "trajectory_tokens_median"), _median(steps, "trajectory_tokens_max"),
            _median(steps, "version_lag_mean"), max(lags) if lags else None,
            _mean(rewards[-last:]), _mean(in_time),
        ])  # fmt: skip
    columns = [
        "k", "steps", "wall s after step 1", "step s", f"vs k={runs[0][0]}", "mean step s", f"mean vs k={runs[0][0]}",
        "rollout s", "learn s", "generator idle s",
        "traj tokens p50", "traj tokens max",
        "lag mean", "lag max", f"reward (last {last})", f"reward at {horizon:.0f} s",
    ]  # fmt: skip
    return markdown_table(columns, rows)


def plot(runs: list[tuple[int, list[dict[str, Any]]]], path: Path, title: str) -> None:
    """Reward against step and against wall time, one line per k."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4), layout="constrained")
    by_step, by_time = figure.subplots(1, 2)
    for k, steps in runs:
        rewarded = [s for s in steps if s.get("reward_mean") is not None]
        by_step.plot([s["step"] for s in rewarded], [s["reward_mean"] for s in rewarded], marker=".", label=f"k = {k}")
        by_time.plot(
            [s["wall_s"] for s in rewarded], [s["reward_mean"] for s in rewarded], marker=".", label=f"k = {k}"
        )
    by_step.set(xlabel="step", ylabel="reward_mean", title="reward per step")
    by_time.set(xlabel="wall time after step 1 (s, sum of step_s)", ylabel="reward_mean", title="reward against time")
    by_step.legend()
    by_time.legend()
    figure.suptitle("\n".join(textwrap.wrap(title, 160)), fontsize=9)  # a long command on two lines
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=ROOT / "examples" / "agent_grpo.toml")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--last", type=int, default=4, help="steps whose reward is averaged for the last column")
    parser.add_argument("--key", default="run.max_staleness", help="the file's field that sets k")
    parser.add_argument("--long-tail", action="store_true", help="the long-tail agent workload (module docstring)")
    parser.add_argument("--warmup-cache", type=Path, default=None, help="objects.model.cache of every run")
    parser.add_argument("--plot", type=Path, default=None, help="a PNG: reward per step and against wall time")
    parser.add_argument("--keep", type=Path, default=None, help="a folder: each run's metrics file as k<K>.jsonl")
    parser.add_argument(
        "--kept", type=Path, default=None, help="run nothing: the table (and plot) of a --keep folder's k<K>.jsonl"
    )
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    command = "python bench/staleness.py " + " ".join(argv)
    cache = ["--set", f"objects.model.cache={args.warmup_cache.resolve()}"] if args.warmup_cache else []
    extra = (LONG_TAIL if args.long_tail else []) + cache + extra
    print(header(command))
    if args.kept is not None:
        runs = [(k, read_steps(args.kept / f"k{k}.jsonl")) for k in args.k]
    else:
        with tempfile.TemporaryDirectory() as scratch:
            runs = [(k, run_once(args.file.resolve(), k, args, extra, Path(scratch))) for k in args.k]
    print(summarize(runs, args.last))
    if args.plot is not None:
        plot(runs, args.plot, command)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
