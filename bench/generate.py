"""TorchGenerator against transformers' `generate` on a random Qwen3-0.6B-shaped model, and a long-tail rollout.

    python bench/generate.py                 # H200: bf16, batch 1/8/32/64/128, 128-token prompts, 256 new
    python bench/generate.py --tiny          # CPU smoke run of the same code on a tiny model
    python bench/generate.py --batches 1 --no-long-tail     # one row, without the long-tail rollout
    python bench/generate.py --host-only     # CPU: the host's time per decode step, the device's work replaced by nothing

Both sample at temperature 1 with no top-k/top-p and no stop token, from the same random prompts.
Ours runs through the public async API (`generate_many`); each batcher step is timed (the first
step prefills) and synchronized, so "ms/step" adds the host's work to the device's; "ms/step,
untimed run" is the same batch again without timing, where one step ahead overlaps the host's
work with the step in flight, as generation runs. The floor is the bytes one decode step must read (weights + the KV cache of the
mean context) over the copy bandwidth measured in the same run.

The long-tail rollout is issue 14's workload: 64 sequences with ~512-token prompts (uniform in
448..576) and response lengths 64 x lognormal(1.5, 1) clipped to 64..2048 (seeded; 26,711
tokens), max_batch 64, no stop token. Most of its 2048 steps a few sequences decode alone over
contexts of 1-2.5k tokens, so its speed is the small-batch step time plus attention over long
keys. It runs once to warm up (compile, graph captures: the same shapes recur every training
step) and is then timed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import header, markdown_table
from thundersync.acceleration import Acceleration
from thundersync.generation import GenerationRequest, SamplingParams, TorchGenerator, generate_many


def make_model(tiny: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = (
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=128,
            vocab_size=512,
        )
        if tiny
        else dict(
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=151936,
        )
    )
    config = Qwen3Config(
        **shape,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (start.elapsed_time(end) / 1e3)


KERNEL_TABLES: list[tuple[int, list[list[object]]]] = []  # (batch, rows) of --kernel-table


def kernels_in(step: Callable[[], list], device: torch.device, table_batch: int | None = None) -> float:
    """How many device kernels one call of ``step`` launches (CUDA only; a graph replay counts its kernels).

    With ``table_batch``, the kernels grouped by name (count, total and mean device time) go to
    ``KERNEL_TABLES``."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if table_batch is not None:
        groups: dict[str, list[float]] = {}
        for e in kernels:
            groups.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
        total = sum(sum(t) for t in groups.values())
        rows = sorted(
            ([name, len(t), sum(t), sum(t) / len(t), sum(t) / total] for name, t in groups.items()), key=lambda r: -r[2]
        )
        KERNEL_TABLES.append((table_batch, rows))
    return len(kernels)


def run_ours(
    model: torch.nn.Module, prompts: torch.Tensor, new: int, device: torch.device, table: bool = False
) -> tuple[float, float, float, float, float]:
    """(seconds, median decode-step seconds, first-step seconds, kernels of a decode step, seconds
    untimed) of a full batch through TorchGenerator. Each timed step synchronizes, so the host's
    work and the device's add up in it; the untimed run is the same batch as generation runs it
    (one step ahead: the host's work overlaps the step in flight), its per-step time taken
    after the timed run's first (prefill) step."""
    batch, prompt_len = prompts.shape
    generator = TorchGenerator(model, max_batch=batch, max_seq_len=prompt_len + new, prefill_tokens=batch * prompt_len)
    params = SamplingParams(temperature=1.0, max_new_tokens=new)
    requests = [GenerationRequest(prompt_ids=p, params=params) for p in prompts.tolist()]
    batcher = generator._batcher  # bench-only: time each batcher step, count one step's kernels
    steps: list[float] = []
    kernels: list[float] = []
    plain_step = batcher.step

    def timed_step() -> list:
        if len(steps) == 8 and not kernels:  # a decode step, profiled apart from the timed ones
            finished: list = []
            kernels.append(kernels_in(lambda: finished.extend(plain_step()), device, batch if table else None))
            return finished
        start = time.perf_counter()
        finished = plain_step()
        sync(device)
        steps.append(time.perf_counter() - start)
        return finished

    batcher.step = timed_step  # type: ignore[method-assign]
    anyio.run(generate_many, generator, requests)  # warm-up: captures the decode graphs
    steps.clear()
    sync(device)
    start = time.perf_counter()
    results = anyio.run(generate_many, generator, requests)
    sync(device)
    seconds = time.perf_counter() - start
    assert all(len(r.token_ids) == new for r in results)
    batcher.step = plain_step  # type: ignore[method-assign]  # untimed: the host's work overlaps the device's
    start = time.perf_counter()
    anyio.run(generate_many, generator, requests)
    sync(device)
    pipelined = time.perf_counter() - start
    return seconds, statistics.median(steps[1:]), steps[0], kernels[0], pipelined


def long_tail_workload(tiny: bool, vocab: int) -> list[GenerationRequest]:
    """Issue 14's rollout: 64 prompts of ~512 tokens, 64 x lognormal(1.5, 1) new tokens in 64..2048 (tiny: / 16)."""
    scale = 16 if tiny else 1
    count, prompt, low, high = 64 // (4 if tiny else 1), 512 // scale, 64 // scale, 2048 // scale
    rng = torch.Generator().manual_seed(14)
    normal = torch.randn(count, generator=rng, dtype=torch.float64)
    lengths = [min(high, max(low, round(low * math.exp(1.5 + z)))) for z in normal.tolist()]
    prompt_lens = torch.randint(prompt - prompt // 8, prompt + prompt // 8 + 1, (count,), generator=rng).tolist()
    return [
        GenerationRequest(
            prompt_ids=torch.randint(1, vocab, (n,), generator=rng).tolist(),
            params=SamplingParams(temperature=1.0, max_new_tokens=new, seed=i),
        )
        for i, (n, new) in enumerate(zip(prompt_lens, lengths, strict=True))
    ]


def run_long_tail(
    model: torch.nn.Module, requests: list[GenerationRequest], device: torch.device
) -> tuple[float, int, float]:
    """(seconds, generated tokens, warm-up seconds) of the long-tail rollout through TorchGenerator."""
    longest = max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests)
    generator = TorchGenerator(model, max_batch=len(requests), max_seq_len=longest + 1)
    start = time.perf_counter()
    anyio.run(generate_many, generator, requests)  # warm-up: compile and graph captures
    sync(device)
    warm_up = time.perf_counter() - start
    start = time.perf_counter()
    results = anyio.run(generate_many, generator, requests)
    sync(device)
    seconds = time.perf_counter() - start
    assert [len(r.token_ids) for r in results] == [r.params.max_new_tokens for r in requests]
    return seconds, sum(len(r.token_ids) for r in results), warm_up


def run_host_only(live: int) -> tuple[float, float, int]:
    """(ms per step through ``generate_many``, the batcher's median ms per step, steps) of ``live``
    sequences with the decode step's device work replaced by nothing: the host's own cost per step
    (bookkeeping, the weights check, the worker-thread visits), which bounds the step from below
    once the device's work is hidden behind it. A model with Qwen3-0.6B's 28 layers and tiny
    widths on CPU: the host's cost depends on the module count, not the widths."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
    config = Qwen3Config(num_hidden_layers=28, vocab_size=512, tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    generator = TorchGenerator(
        model, max_batch=max(live, 2), max_seq_len=600, cuda_graphs=False, acceleration=Acceleration(decode_fuse="on")
    )
    batcher = generator._batcher  # bench-only: no device work, time each batcher step
    assert batcher.fixed is not None

    def no_device_work(bucket: int, key_len: int, filtered: bool) -> torch.Tensor:
        batcher.fixed.out[:bucket, 0] = 7
        return batcher.fixed.out[:bucket]

    batcher.run_fixed = no_device_work
    params = SamplingParams(temperature=1.0, max_new_tokens=500)
    requests = [GenerationRequest(prompt_ids=[3 + i] * 20, params=params) for i in range(live)]
    anyio.run(generate_many, generator, requests)  # warm-up
    steps: list[float] = []
    plain_step = batcher.step

    def timed_step() -> list:
        start = time.perf_counter()
        finished = plain_step()
        steps.append(time.perf_counter() - start)
        return finished

    batcher.step = timed_step  # type: ignore[method-assign]
    start = time.perf_counter()
    anyio.run(generate_many, generator, requests)
    seconds = time.perf_counter() - start
    return seconds / len(steps) * 1e3, statistics.median(steps) * 1e3, len(steps)


def run_transformers(model: torch.nn.Module, prompts: torch.Tensor, new: int, device: torch.device) -> float:
    kwargs = dict(
        max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None
    )
    mask = torch.ones_like(prompts)
    model.generate(prompts[:, :8], attention_mask=mask[:, :8], **{**kwargs, "max_new_tokens": 4})  # warm-up
    sync(device)
    start = time.perf_counter()
    out = model.generate(prompts, attention_mask=mask, **kwargs)
    sync(device)
    assert out.shape[1] == prompts.shape[1] + new
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (a smoke run)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes")
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument("--baseline-new", type=int, default=None, help="new tokens for transformers (it is slow)")
    parser.add_argument("--no-long-tail", action="store_true", help="skip the long-tail rollout")
    parser.add_argument(
        "--kernel-table", action="store_true", help="print each batch's profiled decode step, kernels grouped by name"
    )
    parser.add_argument(
        "--host-only", action="store_true", help="the host's time per decode step without device work (CPU)"
    )
    args = parser.parse_args()
    if args.host_only:
        print(header(" ".join(["python", *sys.argv])))
        rows = [[live, *run_host_only(live)] for live in (1, 16, 64)]
        columns = ["live sequences", "ms per step (generate_many)", "batcher step median ms", "steps"]
        print(markdown_table(columns, rows))
        return
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batches = [int(b) for b in (args.batches or ("1,2,4" if args.tiny else "1,8,32,64,128")).split(",")]
    prompt_len = args.prompt or (16 if args.tiny else 128)
    new = args.new or (32 if args.tiny else 256)
    baseline_new = args.baseline_new or new
    model = make_model(args.tiny, device, dtype)
    bandwidth = copy_bandwidth(device)
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = (
        2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * torch.finfo(dtype).bits // 8
    )
    rows = []
    for batch in batches:
        prompts = torch.randint(
            1, config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(batch)
        ).to(device)
        ours, step, first, kernels, pipelined = run_ours(model, prompts, new, device, args.kernel_table)
        theirs = run_transformers(model, prompts, baseline_new, device)
        floor_bytes = weight_bytes + batch * (prompt_len + new / 2) * kv_per_token
        floor_step = floor_bytes / bandwidth
        rows.append(
            [
                batch,
                batch * new / ours,
                step * 1e3,
                (pipelined - first) / (new - 1) * 1e3,
                kernels,
                first * 1e3,
                batch * baseline_new / theirs,
                theirs / baseline_new * 1e3,
                theirs / baseline_new / (ours / new),
                floor_step * 1e3,
                batch / floor_step,
            ]
        )
    print(header(" ".join(["python", *sys.argv])))
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {dtype}, prompt {prompt_len}, "
        f"new {new} (transformers: {baseline_new}), copy bandwidth {bandwidth / 1e9:.0f} GB/s\n"
    )
    print(
        markdown_table(
            [
                "batch",
                "ours tok/s",
                "ours ms/step",
                "ours ms/step, untimed run",
                "ours kernels/step",
                "ours first step ms",
                "transformers tok/s",
                "transformers ms/step",
                "speed-up",
                "floor ms/step",
                "floor tok/s",
            ],
            rows,
        )
    )
    for batch, table in KERNEL_TABLES:
        print(f"\nbatch {batch}: one decode step's kernels (device time, us)\n")
        print(markdown_table(["kernel", "count", "total us", "mean us", "share"], table))
    if not args.no_long_tail:
        requests = long_tail_workload(args.tiny, config.vocab_size)
        seconds, tokens, warm_up = run_long_tail(model, requests, device)
        print("\nlong-tail rollout (issue 14: 64 prompts ~512, new 64 x lognormal(1.5, 1) in 64..2048, max_batch 64)\n")
        print(
            markdown_table(
                ["sequences", "tokens", "seconds", "tok/s", "first run s (compile, captures)"],
                [[len(requests), tokens, seconds, tokens / seconds, warm_up]],
            )
        )


if __name__ == "__main__":
    main()
