"""Where streaming time goes: each engine phase timed with the device synchronized around it.

    python bench/engine_phases.py            # H200: GRPO 2 groups x 8 and OPD 1 group x 4, bf16 0.6B-shaped
    python bench/engine_phases.py --tiny     # the same on CPU with a tiny model, in seconds

One table, one run: for GRPO and OPD streaming (the modes of ``bench/engine.py`` and
``bench/engine_opd.py``, run inline so phases do not overlap), the total milliseconds and the
count of each phase, from the second of two runs (the first compiles and probes). Phases:
``pack.forward`` and ``pack.backward`` (a :class:`~thundersync.engine.forest.SegmentPack`'s forward
and backward, the head's log-probs apart), ``head log-probs``, ``ancestor adjoints`` (splitting
the proxies' gradients per ancestor; part of ``pack.backward``), ``ledger add``, ``accumulate``
(scratch into an fp32 accumulator). A phase far above the arithmetic it does (about 1 ms per 500 tokens forward on
the H200 for this model) is overhead: launches, Python, or synchronization. Wall time minus the
phases is the caller's own work (validation, bookkeeping).

This is a diagnostic: it wraps engine internals, so it changes their timing (each phase
synchronizes) but not their results.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import thundersync
from bench._common import header, markdown_table
from bench.engine import make_batch, make_model, streaming
from bench.engine_opd import make_opd_batch, opd_streaming
from thundersync.engine import forest, sinks

PHASES = {  # label: (owner, attribute)
    "pack.forward": (forest.SegmentPack, "forward"),
    "pack.backward": (forest.SegmentPack, "backward"),
    "head log-probs": (forest.SegmentPack, "scored_logprobs"),
    "ancestor adjoints": (forest.SegmentPack, "_ancestor_adjoints"),
    "ledger add": (forest.AdjointLedger, "add"),
    "accumulate": (sinks.FlatAccumulator, "add_scratch"),
}


@contextlib.contextmanager
def timed_phases(totals: dict[str, float], counts: collections.Counter[str], cuda: bool) -> Iterator[None]:
    """Within the block, every phase in PHASES adds its synchronized wall time to ``totals``."""
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    saved = {label: owner.__dict__[name] for label, (owner, name) in PHASES.items()}

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                totals[label] += time.perf_counter() - start
                counts[label] += 1

        return run

    try:
        for label, (owner, name) in PHASES.items():
            raw = saved[label]
            wrapped = classmethod(timed(label, raw.__func__)) if isinstance(raw, classmethod) else timed(label, raw)
            setattr(owner, name, wrapped)
        yield
    finally:
        for label, (owner, name) in PHASES.items():
            setattr(owner, name, saved[label])


def measure(
    mode: Callable[[torch.nn.Module, Any], None], model: torch.nn.Module, batch: Any, cuda: bool
) -> tuple[float, dict[str, float], collections.Counter[str]]:
    """(wall seconds, phase seconds, phase counts) of the second of two inline runs of ``mode``."""
    real_run = thundersync.StreamingRun
    thundersync.StreamingRun = functools.partial(real_run, background=False)  # type: ignore[misc]
    try:
        for attempt in range(2):
            for p in model.parameters():
                p.grad = None
            totals: dict[str, float] = collections.defaultdict(float)
            counts: collections.Counter[str] = collections.Counter()
            with timed_phases(totals, counts, cuda):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                mode(model, batch)
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - start
            print(f"[done] {getattr(mode, '__name__', mode)} run {attempt}: {wall:.3f} s", file=sys.stderr, flush=True)
    finally:
        thundersync.StreamingRun = real_run  # type: ignore[misc]
    return wall, totals, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and batches on CPU (seconds)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    model = make_model(
        args.tiny, torch.device("cuda" if cuda else "cpu"), torch.float32 if args.tiny else torch.bfloat16
    )
    vocab = model.config.vocab_size
    if args.tiny:
        grpo_batch = make_batch(random.Random(0), vocab, groups=2, size=4, prompt=(24, 40), response=(4, 64))
        opd_batch = make_opd_batch(random.Random(1), vocab, 1, 3, (16, 24), (4, 24), (2, 12), (2, 3))
    else:
        grpo_batch = make_batch(random.Random(0), vocab, groups=2, size=8, prompt=(480, 544), response=(64, 2048))
        opd_batch = make_opd_batch(random.Random(1), vocab, 1, 4, (480, 544), (64, 512), (32, 256), (2, 4))
    results = {
        "GRPO": measure(streaming, model, grpo_batch, cuda),
        "OPD": measure(opd_streaming, model, opd_batch, cuda),
    }
    rows = [["wall time", *(f"{wall * 1e3:.1f}" for wall, _, _ in results.values())]]
    for label in PHASES:
        rows.append(
            [label, *(f"{totals[label] * 1e3:.1f} (x{counts[label]})" for _, totals, counts in results.values())]
        )
    grpo_tokens = sum(len(g.prompt) + len(t.response) for g in grpo_batch for t in g.trajectories)
    opd_tokens = sum(len(g.prompt) + sum(map(len, t.turns)) for g in opd_batch for t in g.trajectories)
    print(header("python bench/engine_phases.py" + (" --tiny" if args.tiny else "")))
    print(
        f"GRPO: {len(grpo_batch)} groups x {len(grpo_batch[0].trajectories)} trajectories, {grpo_tokens} tokens; "
        f"OPD: {len(opd_batch)} group x {len(opd_batch[0].trajectories)} trajectories, {opd_tokens} tokens; "
        f"dtype {next(model.parameters()).dtype}\n"
    )
    print(markdown_table(["phase", *(f"{name} ms (count)" for name in results)], rows))


if __name__ == "__main__":
    main()
