"""What one teacher scoring costs: transformers' forward against ``PackedScorer``, eager and graphed.

    python bench/teacher_cost.py          # H200: Qwen3-0.6B-shaped bf16 teacher, prompt 512, 64..2048 response tokens
    python bench/teacher_cost.py --tiny   # CPU, tiny model (checks the script; no graphs column)

One sequence per call, as ``bench/overlap.py``'s OPD teacher scores each trajectory: the wall
time of a call (host launches, then the wait for the device and the copy of the log-probs), the
median of 5 after 3 warm-ups, and the largest difference of the log-probs from transformers'.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import header, markdown_table
from bench.engine import padded_logprobs
from bench.overlap import make_teacher
from thundersync.acceleration import Acceleration
from thundersync.model.scoring import PackedScorer


def timed(fn: Callable[[], list[float]]) -> tuple[float, list[float]]:
    for _ in range(3):
        out = fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (seconds)")
    tiny = parser.parse_args().tiny
    device = torch.device("cpu" if tiny else "cuda")
    model = make_teacher(tiny, device, torch.float32 if tiny else torch.bfloat16).anatomy.model
    eager = PackedScorer(model, acceleration=Acceleration(scorer_graphs="off"))
    graphed = None if tiny else PackedScorer(model)
    prompt = list(range(100, 112 if tiny else 612))
    rows = []
    for n in (4, 40) if tiny else (64, 400, 2048):
        sequence = prompt + list(range(300, 300 + n))
        positions = list(range(len(prompt) - 1, len(sequence) - 1))

        def transformers() -> list[float]:
            with torch.no_grad():
                return padded_logprobs(model, [sequence], [positions]).double().cpu().tolist()  # noqa: B023

        base_ms, base = timed(transformers)
        eager_ms, by_eager = timed(lambda: eager.logprobs([sequence], [n])[0])  # noqa: B023
        diff_eager = max(abs(a - b) for a, b in zip(base, by_eager, strict=True))
        if graphed is None:
            rows.append([n, base_ms, eager_ms, "-", "-", f"{diff_eager:.3g}", "-"])
            continue
        graph_ms, by_graph = timed(lambda: graphed.logprobs([sequence], [n])[0])  # noqa: B023
        diff = max(abs(a - b) for a, b in zip(base, by_graph, strict=True))
        rows.append([n, base_ms, eager_ms, graph_ms, base_ms / graph_ms, f"{diff_eager:.3g}", f"{diff:.3g}"])
    print(header(" ".join(["python", *sys.argv])))
    print(f"prompt {len(prompt)} tokens, one sequence per call, {next(model.parameters()).dtype}\n")
    columns = [
        "response tokens",
        "transformers ms",
        "PackedScorer eager ms",
        "PackedScorer graphs ms",
        "speed-up",
        "max diff eager",
        "max diff graphs",
    ]
    print(markdown_table(columns, rows))
    if graphed is not None:
        print(f"\nscorer counts: {dict(graphed.counts)}")


if __name__ == "__main__":
    main()
