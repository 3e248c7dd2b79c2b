"""Streaming OPD benchmark: per-action backward latency and total streamed compute vs dense.

    python bench/engine_opd.py            # H200: bf16 Qwen3-0.6B-shaped student, 4 groups x 8 trajectories
    python bench/engine_opd.py --tiny     # CPU, tiny model, seconds (checks the script)

One table, one run, the same batch for every row: multi-turn trajectories (2-4 actions of
64-512 tokens with 32-256-token tool observations between them, ~512-token prompts), teacher
log-probs for every action token. ``dense`` runs whole sequences in padded micro-batches of 8
through transformers' forward with fused log-probs and forms the loss directly; ``streaming``
appends turns round-robin across all trajectories (agents in flight) to an ``OPDStream``, each
action backpropagated at its append, ledgers replayed at close. The latency columns come from
separate passes that wait for each action's backward (time from ``append_turn`` to its gradient
being done), run twice: a lone action's pack has other shapes than the streamed run's packs of
several actions, so the first pass still captures CUDA graphs (0.5-0.8 s each on the H200); the
p50 and p95 columns are the second pass's, as a training run sees them once its shapes are
captured, and the first pass's are beside them. Relative errors are against the dense gradient
of an fp32 copy of the model.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import thundersync
from bench._common import engine_layers, header, markdown_table, release_engine_graphs
from bench.engine import make_model, measure, padded_logprobs, profile, relative_error


@dataclass
class OPDTrajectory:
    turns: list[list[int]]  # alternating action, observation, action, ...
    teacher: list[list[float]]  # per action turn: one teacher log-prob per token ([] for observations)


@dataclass
class OPDGroup:
    prompt: list[int]
    trajectories: list[OPDTrajectory]


def make_opd_batch(
    rng: random.Random,
    vocab: int,
    groups: int,
    size: int,
    prompt: tuple[int, int],
    action: tuple[int, int],
    observation: tuple[int, int],
    actions: tuple[int, int],
) -> list[OPDGroup]:
    """Multi-turn agent trajectories: 2-4 actions with tool observations between them."""
    batch = []
    for _ in range(groups):
        trajs = []
        for _ in range(size):
            turns, teacher = [], []
            count = rng.randint(*actions)
            for k in range(2 * count - 1):
                length = rng.randint(*(action if k % 2 == 0 else observation))
                turns.append([rng.randrange(vocab) for _ in range(length)])
                teacher.append([-rng.uniform(0.5, 8.0) for _ in range(length)] if k % 2 == 0 else [])
            trajs.append(OPDTrajectory(turns, teacher))
        batch.append(OPDGroup([rng.randrange(vocab) for _ in range(rng.randint(*prompt))], trajs))
    return batch


def opd_dense(model: torch.nn.Module, batch: list[OPDGroup], micro: int = 8) -> None:
    """Synchronous OPD: whole sequences in padded micro-batches, the loss formed directly."""
    items = []
    for group in batch:
        for traj in group.trajectories:
            seq, positions, teacher = list(group.prompt), [], []
            for turn, q in zip(traj.turns, traj.teacher):
                if q:
                    positions += range(len(seq) - 1, len(seq) - 1 + len(turn))
                    teacher += q
                seq += turn
            items.append((seq, positions, teacher))
    count = sum(len(t) for _, _, t in items)
    items.sort(key=lambda item: len(item[0]))
    for start in range(0, len(items), micro):
        chunk = items[start : start + micro]
        lp = padded_logprobs(model, [seq for seq, _, _ in chunk], [pos for _, pos, _ in chunk])
        teacher = torch.tensor([q for _, _, qs in chunk for q in qs]).to(lp)
        b = lp.detach()
        (torch.exp(lp - b) * (b - teacher)).sum().div(count).backward()


def opd_streaming(model: torch.nn.Module, batch: list[OPDGroup], latencies: list[float] | None = None) -> None:
    """OPDStream: every group open, turns appended round-robin across trajectories (agents in
    flight), each action's backward queued at its append. With ``latencies``, wait for each
    action's backward and record its latency (that serializes the run: a separate measurement)."""
    opd = thundersync.OPDStream(thundersync.StreamingRun(model))
    cuda = next(model.parameters()).is_cuda
    for g, group in enumerate(batch):
        opd.open_group(g, group.prompt)
    depth = max(len(t.turns) for group in batch for t in group.trajectories)
    for k in range(depth):
        for g, group in enumerate(batch):
            for i, traj in enumerate(group.trajectories):
                if k >= len(traj.turns):
                    continue
                turn, q = traj.turns[k], traj.teacher[k]
                start = time.perf_counter()
                opd.append_turn(g, i, turn, [bool(q)] * len(turn), teacher_logprobs=q or None)
                if latencies is not None and q:
                    opd.run.worker.join()
                    if cuda:
                        torch.cuda.synchronize()
                    latencies.append(time.perf_counter() - start)
                if k == len(traj.turns) - 1:
                    opd.close_trajectory(g, i)
    for g in range(len(batch)):
        opd.close_group(g)
    opd.assert_safe_to_step()


def opd_table(
    model: torch.nn.Module, tiny: bool, cuda: bool, repeat: int, forms: Sequence[str] = ("graphs",)
) -> tuple[str, list[list[object]]]:
    vocab = model.config.vocab_size
    if tiny:
        batch = make_opd_batch(random.Random(1), vocab, 2, 3, (16, 24), (4, 24), (2, 12), (2, 3))
    else:
        batch = make_opd_batch(random.Random(1), vocab, 2, 8, (480, 544), (64, 512), (32, 256), (2, 4))
    tokens = sum(len(g.prompt) + sum(map(len, t.turns)) for g in batch for t in g.trajectories)
    scored = sum(len(q) for g in batch for t in g.trajectories for q in t.teacher)
    reference = copy.deepcopy(model).float()
    _, _, want = measure(opd_dense, reference, batch, cuda, repeat=0)
    del reference
    if cuda:
        torch.cuda.empty_cache()
    rows = []
    dense_s, dense_peak, dense_grads = measure(opd_dense, model, batch, cuda, repeat)
    rows.append(
        [
            "dense OPD (padded micro-batches of 8, fused log-probs)",
            dense_s,
            tokens / dense_s,
            1.0,
            dense_peak,
            "",
            "",
            "",
            relative_error(dense_grads, want),
        ]
    )
    for name, layers in ((name, layers) for name, layers in FORMS if layers in forms):
        release_engine_graphs(model)  # one form's graphs at a time: two sets need more than the device has
        with engine_layers(layers):
            stream_s, stream_peak, stream_grads = measure(opd_streaming, model, batch, cuda, repeat)
            passes: list[list[float]] = [[], []]  # the first captures the buckets of lone actions
            for latencies in passes:
                opd_streaming(model, batch, latencies)
                latencies.sort()
        first, latencies = passes
        rows.append(
            [
                f"streaming OPD (OPDStream, backward at each action){name}",
                stream_s,
                tokens / stream_s,
                stream_s / dense_s,
                stream_peak,
                _quantile(latencies, 0.5) * 1e3,
                _quantile(latencies, 0.95) * 1e3,
                f"{_quantile(first, 0.5) * 1e3:.1f} / {_quantile(first, 0.95) * 1e3:.1f}",
                relative_error(stream_grads, want),
            ]
        )
    if cuda:
        from thundersync.engine import graph_counts

        print(f"engine graphs (whole run): {graph_counts()}", file=sys.stderr, flush=True)
    info = (
        f"OPD batch: {len(batch)} groups x {len(batch[0].trajectories)} trajectories, {tokens} tokens, "
        f"{scored} scored, {len(latencies)} actions"
    )
    return info, rows


def _quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (the nearest rank at or below)."""
    return values[min(len(values) - 1, int(q * len(values)))]


FORMS = (  # (row suffix, engine_layers mode)
    ("", "graphs"),
    (", pack graphs of the eager layer math (THUNDERSYNC_ENGINE_FUSED=off)", "unfused-graphs"),
    (", fused layer math, no graphs", "fused"),
    (", pack graphs of the compiled layers (THUNDERSYNC_ENGINE_COMPILE=on)", "compiled-graphs"),
    (", layer graphs only (THUNDERSYNC_ENGINE_PACK_GRAPHS=off)", "layers"),
    (", eager (both graph switches off)", "eager"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and batch on CPU (seconds)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="after the table, profile one run of each mode")
    every = ",".join(layers for _, layers in FORMS)
    parser.add_argument("--forms", default=every, help=f"the streamed rows' forms, comma-separated, of {every}")
    args = parser.parse_args()
    forms = args.forms.split(",")
    if unknown := [f for f in forms if f not in every.split(",")]:
        parser.error(f"unknown form(s) {', '.join(unknown)}; the forms are {every}")
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    model = make_model(args.tiny, device, torch.float32 if args.tiny else torch.bfloat16)
    info, rows = opd_table(model, args.tiny, cuda, args.repeat, forms)
    print(header("python bench/engine_opd.py" + (" --tiny" if args.tiny else "")))
    print(f"{info}, dtype {next(model.parameters()).dtype}\n")
    print(
        markdown_table(
            [
                "mode",
                "seconds",
                "tokens/s",
                "time vs dense",
                "peak GiB",
                "per-action backward p50 ms",
                "p95 ms",
                "first pass p50 / p95 ms",
                "rel. err vs fp32 dense",
            ],
            rows,
        )
    )
    if args.profile:
        batch = make_opd_batch(
            random.Random(1), model.config.vocab_size, 1, 4, (480, 544), (64, 512), (32, 256), (2, 4)
        )
        profile(model, batch, cuda, (("dense OPD", opd_dense), ("streaming OPD", opd_streaming)))


if __name__ == "__main__":
    main()
