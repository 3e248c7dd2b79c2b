"""What ``[run] deterministic = true`` costs: wall time of a short training run with and without.

    python bench/deterministic.py            # ~1 min on a 2-core CPU machine
    python bench/deterministic.py --tiny     # one short run each (checks the script: 1 step, 4 tokens)

Runs ``examples/train_tiny_grpo.toml`` in process (``thundersync run`` through its ``main``), with
``--set`` overrides making it a bigger batch (8 samples x 2 groups, 24 new tokens, 3 steps), each
configuration ``--repeat`` times, interleaved, after one untimed warm-up of each. A run's time is
its ``run_finished`` record's ``elapsed_s`` (the graph, not the imports); ``rollout s`` and
``learn s`` are the sums over its step records (the batch's generation; the step's wait for
the queued backward work and the optimizer step). The table shows medians, the fastest run, and
the median's ratio to the default run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import header, markdown_table
from thundersync.app.cli.command import main

FILE = Path(__file__).resolve().parent.parent / "examples" / "train_tiny_grpo.toml"
SHAPE = ("stages.source.samples=8", "stages.source.repeat=3", "stages.generate.max_new_tokens=24", "run.steps=3")
TINY = ("stages.source.samples=8", "stages.source.repeat=1", "stages.generate.max_new_tokens=4", "run.steps=1")
CONFIGS = {"default": (), "deterministic": ("run.deterministic=true",)}


def one_run(directory: Path, dtype: str, sets: tuple[str, ...], shape: tuple[str, ...]) -> tuple[float, float, float]:
    """The graph's seconds of one run (its run_finished record), its rollout and learn seconds."""
    metrics = directory / "m.jsonl"
    argv = ["run", str(FILE), "--metrics", str(metrics), "--no-progress", "--overwrite"]
    for item in (*shape, f'objects.model.dtype="{dtype}"', f'objects.checkpointer.directory="{directory}/ckpt"', *sets):
        argv += ["--set", item]
    assert main(argv) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["event"] == "run_finished", records[-1]
    steps = [r for r in records if r["event"] == "step"]
    return float(records[-1]["elapsed_s"]), sum(r["rollout_s"] for r in steps), sum(r["learn_s"] for r in steps)


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--tiny", action="store_true", help="one run of each, no warm-up")
    args = parser.parse_args()
    repeat, shape = (1, TINY) if args.tiny else (args.repeat, SHAPE)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.tiny:
            for sets in CONFIGS.values():
                one_run(Path(tmp), args.dtype, sets, shape)
        for _ in range(repeat):
            for name, sets in CONFIGS.items():
                times[name].append(one_run(Path(tmp), args.dtype, sets, shape))
    base = statistics.median(t[0] for t in times["default"])
    rows = []
    for name, runs in times.items():
        total, rollout, learn = (statistics.median(column) for column in zip(*runs, strict=True))
        rows.append([name, total, min(t[0] for t in runs), total / base, rollout, learn, len(runs)])
    print(header("python bench/deterministic.py " + " ".join(sys.argv[1:])))
    print(f"{args.dtype}, overrides: {' '.join(shape)}\n")
    columns = ["run", "median s", "fastest s", "median / default", "rollout s", "learn s", "runs"]
    print(markdown_table(columns, rows))


if __name__ == "__main__":
    main_bench()
