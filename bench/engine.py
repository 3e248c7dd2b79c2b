"""Streaming engine benchmark: dense packed forward+backward of a GRPO batch vs streaming it.

    python bench/engine.py            # H200: bf16 Qwen3-0.6B-shaped random model, 8 groups x 8 trajectories
    python bench/engine.py --tiny     # the same on CPU with a tiny model, in seconds (checks the script)

One table, one run. Every mode computes the gradient of the same GRPO objective on the same
batch (prompts ~512 tokens, responses 64-2048 long-tailed, binary rewards) into ``p.grad``:

- ``dense``: each trajectory's full sequence (prompt + response), sorted by length, in padded
  micro-batches of 8 through transformers' own forward (SDPA), log-probs from the fused
  ``kernels.linear_logprobs`` (no [N, V] logits), J formed directly, ``backward()``.
- ``streaming``: ``RewardLinearBackward`` on a ``StreamingRun`` (fp32 accumulators), all groups
  open, trajectories closed one by one in a shuffled order across groups, groups closed as
  their last trajectory closes; ``assert_safe_to_step()`` ends the timed region.
- ``streaming, pack_tokens=2048``: the same with packs of at most 2048 tokens, the largest the
  whole-pack CUDA graphs hold by default (8192-token packs take the per-layer graphs);
- ``streaming, pack_tokens=0``: the same with every trajectory backpropagated alone at close.

The relative error column compares each mode's bf16 gradient with the dense gradient of an fp32
copy of the model; the line under the table streams that fp32 copy too, which isolates the
engine's own error from bf16 rounding. Modes are functions ``mode(model, batch) -> None`` in ``MODES``; add a row by
adding one (OPD rows can follow the same pattern).
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import thundersync
from bench._common import engine_layers, header, markdown_table
from thundersync.kernels import linear_logprobs

EPS = 1e-6


@dataclass
class Trajectory:
    response: list[int]
    reward: float


@dataclass
class Group:
    prompt: list[int]
    trajectories: list[Trajectory]


Batch = list[Group]


def make_batch(
    rng: random.Random, vocab: int, groups: int, size: int, prompt: tuple[int, int], response: tuple[int, int]
) -> Batch:
    """Long-tailed response lengths: 64 * lognormal(1.5, 1.0) clipped to ``response`` (mean ~470)."""
    lo, hi = response
    scale = lo
    batch = []
    for _ in range(groups):
        p = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        trajs = []
        for _ in range(size):
            n = int(min(hi, max(lo, scale * math.exp(rng.gauss(1.5, 1.0)))))
            trajs.append(Trajectory([rng.randrange(vocab) for _ in range(n)], float(rng.random() < 0.5)))
        batch.append(Group(p, trajs))
    return batch


def advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + EPS) for r in rewards]


def padded_logprobs(model: torch.nn.Module, seqs: list[list[int]], positions: list[list[int]]) -> torch.Tensor:
    """log pi(seq[p + 1] | seq[: p + 1]) at each sequence's ``positions``, concatenated: one padded
    forward through transformers' own model, log-probs from the fused kernel (no [N, V] logits)."""
    device = next(model.parameters()).device
    width = max(len(seq) for seq in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    rows, targets = [], []
    for b, (seq, pos) in enumerate(zip(seqs, positions)):
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
        index = torch.tensor(pos, dtype=torch.long)
        rows.append(b * width + index)
        targets.append(torch.tensor(seq)[index + 1])
    hidden = model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state.flatten(0, 1)
    return linear_logprobs(hidden[torch.cat(rows).to(device)], model.lm_head.weight, torch.cat(targets).to(device))


def dense(model: torch.nn.Module, batch: Batch, micro: int = 8) -> None:
    """The synchronous baseline: padded micro-batches of whole sequences, sorted by length."""
    items = []
    for group in batch:
        for traj, a in zip(group.trajectories, advantages([t.reward for t in group.trajectories])):
            if a != 0.0:
                items.append((group.prompt + traj.response, len(group.prompt), a))
    items.sort(key=lambda item: len(item[0]))
    for start in range(0, len(items), micro):
        chunk = items[start : start + micro]
        positions = [list(range(prompt_len - 1, len(seq) - 1)) for seq, prompt_len, _ in chunk]
        lp = padded_logprobs(model, [seq for seq, _, _ in chunk], positions)
        weights = torch.cat([torch.full((len(pos),), a) for pos, (_, _, a) in zip(positions, chunk)])
        (lp * weights.to(lp.device)).sum().backward()


def streaming(model: torch.nn.Module, batch: Batch, pack_tokens: int = 8192) -> None:
    """All groups open; trajectories close one by one in a shuffled order across groups."""
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), eps=EPS, pack_tokens=pack_tokens)
    order = [(g, i) for g, group in enumerate(batch) for i in range(len(group.trajectories))]
    random.Random(7).shuffle(order)
    remaining = [len(group.trajectories) for group in batch]
    for g, group in enumerate(batch):
        grpo.open_group(g, group.prompt)
    for g, i in order:
        traj = batch[g].trajectories[i]
        grpo.append_turn(g, i, traj.response, [True] * len(traj.response))
        grpo.close_trajectory(g, i, traj.reward)
        remaining[g] -= 1
        if remaining[g] == 0:
            grpo.close_group(g)
    grpo.assert_safe_to_step()


def _layers(form: str, mode: Callable[..., None], model: torch.nn.Module, batch: Any) -> None:
    with engine_layers(form):
        mode(model, batch)


MODES: dict[str, Callable[[torch.nn.Module, Batch], None]] = {
    "dense (padded micro-batches of 8, fused log-probs)": dense,
    "streaming (RewardLinearBackward)": streaming,
    "streaming, eager layer math (THUNDERSYNC_ENGINE_FUSED=off)": lambda m, b: _layers(
        "unfused-graphs", streaming, m, b
    ),
    "streaming, eager (both graph switches and the fused math off)": lambda m, b: _layers("eager", streaming, m, b),
    "streaming, pack graphs of the compiled layers": lambda m, b: _layers("compiled-graphs", streaming, m, b),
    "streaming, pack_tokens=2048 (packs the whole-pack graphs hold)": lambda m, b: streaming(m, b, pack_tokens=2048),
    "streaming, pack_tokens=0 (one trajectory per backward)": lambda m, b: streaming(m, b, pack_tokens=0),
}


def make_model(tiny: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if tiny:
        config = Qwen3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    else:
        config = Qwen3Config(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
        )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval()


def measure(
    mode: Callable[[torch.nn.Module, Batch], None], model: torch.nn.Module, batch: Batch, cuda: bool, repeat: int
) -> tuple[float, float, list[torch.Tensor]]:
    """(median seconds, peak GiB, gradients) of ``mode``; .grad starts as None every run. The
    allocator's cache is emptied before the warm-up run only: the timed runs find what it cached,
    as a trainer's steps after the first do (emptied before every run, as until the eleventh
    session, each timed run took its memory from ``cudaMalloc`` again: ~2,000 calls per streamed
    OPD batch). CUDA graphs the timed runs still captured are reported on stderr."""
    from thundersync.engine import graph_counts

    def captures() -> int:
        return sum(graph_counts().get(k, 0) for k in ("captured", "pack_captured"))

    times, peak = [], 0.0
    captured = 0
    for attempt in range(repeat + 1):  # the first run warms up (probes, autotuning, allocator)
        for p in model.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
            if not attempt:
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = captures()
        start = time.perf_counter()
        mode(model, batch)
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() / 2**30)
        if attempt:
            times.append(time.perf_counter() - start)
            captured += captures() - before
    if captured:
        print(f"{getattr(mode, '__name__', mode)}: the timed runs captured {captured} CUDA graphs", file=sys.stderr)
    grads = [p.grad.detach().float().clone() for p in model.parameters()]
    return (sorted(times)[len(times) // 2] if times else float("nan")), peak, grads


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = sum(float((g.double() - w.double()).pow(2).sum()) for g, w in zip(got, want))
    norm = sum(float(w.double().pow(2).sum()) for w in want)
    return math.sqrt(diff / norm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and batch on CPU (seconds)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], help="substrings of mode names to skip")
    parser.add_argument("--profile", action="store_true", help="after the table, profile one streaming run")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        batch = make_batch(random.Random(0), 512, groups=2, size=4, prompt=(24, 40), response=(4, 64))
        model = make_model(True, device, torch.float32)
    else:
        batch = make_batch(random.Random(0), 151936, groups=8, size=8, prompt=(480, 544), response=(64, 2048))
        model = make_model(False, device, torch.bfloat16)
    tokens = sum(len(g.prompt) + len(t.response) for g in batch for t in g.trajectories)
    responses = sum(len(t.response) for g in batch for t in g.trajectories)

    reference = copy.deepcopy(model).float()
    _, _, want = measure(dense, reference, batch, cuda, repeat=0)
    _, _, fp32_streamed = measure(streaming, reference, batch, cuda, repeat=0)
    engine_error = relative_error(fp32_streamed, want)
    print(f"[done] fp32 reference; engine error {engine_error:.3g}", file=sys.stderr, flush=True)
    del reference, fp32_streamed
    if cuda:
        torch.cuda.empty_cache()

    rows, dense_time, dense_peak = [], None, None
    for name, mode in MODES.items():
        if any(s in name for s in args.skip):
            continue
        seconds, peak, grads = measure(mode, model, batch, cuda, args.repeat)
        print(f"[done] {name}: {seconds:.3f} s, peak {peak:.2f} GiB", file=sys.stderr, flush=True)
        dense_time = dense_time or seconds
        dense_peak = dense_peak or peak
        rows.append(
            [
                name,
                seconds,
                tokens / seconds,
                seconds / dense_time,
                peak,
                peak / dense_peak if dense_peak else float("nan"),
                relative_error(grads, want),
            ]
        )
    command = "python bench/engine.py" + (" --tiny" if args.tiny else "")
    print(header(command))
    print(
        f"batch: {len(batch)} groups x {len(batch[0].trajectories)} trajectories, {tokens} tokens "
        f"({responses} response tokens), dtype {next(model.parameters()).dtype}\n"
    )
    print(
        markdown_table(
            ["mode", "seconds", "tokens/s", "time vs dense", "peak GiB", "peak vs dense", "rel. err vs fp32 dense"],
            rows,
        )
    )
    print(f"\nengine error alone (fp32 copy of the model, streaming vs dense): {engine_error:.3g}")
    if args.profile:
        profile(model, batch, cuda)


def profile(
    model: torch.nn.Module,
    batch: Any,
    cuda: bool,
    modes: Sequence[tuple[str, Callable[[torch.nn.Module, Any], None]]] | None = None,
) -> None:
    """The top device kernels of one run of each mode (default: GRPO dense and streaming)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, mode in modes or (("dense", dense), ("streaming", streaming)):
        with torch_profile(activities=activities) as prof:
            mode(model, batch)
            if cuda:
                torch.cuda.synchronize()
        key = "cuda_time_total" if cuda else "cpu_time_total"
        print(
            f"\n## profile: {name}\n" + prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60)
        )


if __name__ == "__main__":
    main()
