"""The decode step's layer kernels alone, in CUDA graphs, at Qwen3-0.6B's shapes.

    python bench/decode_layer.py            # H200: the graph floor, then each product torch vs ours at 1/8/64 rows
    python bench/decode_layer.py --sweep    # also a sweep of decode_linear's launch configurations (slow: ~500 compiles)

Four tables, each measured in one run:
- the floor: a CUDA graph of 500 one-element adds, microseconds per kernel (launch + tail);
- per product of a layer (q/k/v with the input norm, o with the residual, gate/up with the
  post-attention norm and the activation, down with the residual): torch's eager kernels for the
  same math (norm, product, activation, add) against one `decode_linear`, 28 layers' distinct
  weights per graph (so the weights come from HBM, not L2), microseconds per layer;
- the heads pass (per-head norms, rotary, cache write) against torch's eager form;
- the sampler over Qwen3's 151,936-entry vocabulary (temperature 1, no top-k/top-p): the eager
  sampler against `decode_sample`'s two kernels, both given the same uniform numbers, with
  whether they drew the same tokens and their largest log-prob difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import header, markdown_table
from thundersync.generation._sampling import RowParams, sample, sample_kernels
from thundersync.kernels.decode import (
    LinearConfig,
    block_m,
    decode_attention,
    decode_attention_reference,
    decode_heads,
    decode_heads_reference,
    decode_linear,
    decode_linear_reference,
    linear_config,
)

LAYERS = 28
HIDDEN, INTER, HQ, HKV, D = 1024, 3072, 16, 8, 128
# name: (N, K, prologue)
SHAPES = {
    "qkv + norm": ((HQ + 2 * HKV) * D, HIDDEN, "norm"),
    "o + residual": (HIDDEN, HQ * D, "residual"),
    "gate/up + norm + silu*up": (2 * INTER, HIDDEN, "norm+silu"),
    "down + residual": (HIDDEN, INTER, "residual"),
}


def graph_us(fn: Callable[[], None], calls: int) -> float:
    """Microseconds per call of ``fn``, replayed from a CUDA graph that holds ``calls`` calls back to back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / 20 / calls


def floor_table() -> list[list[object]]:
    y = torch.zeros(1, device="cuda")
    return [["one-element add", graph_us(lambda: y.add_(1.0), 500)]]


def product_inputs(n: int, k: int, prologue: str, rows: int) -> list[dict[str, torch.Tensor]]:
    bf16 = torch.bfloat16
    width = k
    layers = []
    for _ in range(LAYERS):
        inputs = {
            "x": torch.randn(rows, width, device="cuda").to(bf16),
            "w": torch.randn(n, k, device="cuda").to(bf16) * 0.03,
        }
        if prologue.startswith("norm"):
            inputs["norm"] = torch.rand(k, device="cuda").to(bf16) + 0.5
        if prologue == "residual":
            inputs["residual"] = torch.randn(rows, n, device="cuda").to(bf16)
        layers.append(inputs)
    return layers


def kwargs_of(inputs: dict[str, torch.Tensor], prologue: str) -> dict[str, object]:
    if prologue == "norm":
        return {"norm_weight": inputs["norm"], "eps": 1e-6}
    if prologue == "norm+silu":
        return {"norm_weight": inputs["norm"], "eps": 1e-6, "silu_mul": True}
    return {"residual": inputs["residual"]}


def sweep_configs(rows: int) -> list[LinearConfig]:
    """A few launch configurations around the defaults (each costs a compile of a few seconds)."""
    if rows == 1:  # products in registers (the gate/up product's configurations must suit tensor cores too)
        grid = [(16, 1024, 8, 1), (16, 512, 4, 1), (16, 512, 8, 1), (32, 512, 4, 1), (16, 2048, 8, 1)]
        grid += [(16, 1024, 4, 1), (16, 128, 4, 4), (32, 256, 4, 2)]
    elif rows > 16:
        grid = [(64, 128, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (32, 256, 4, 2)]
    else:
        grid = [(16, 256, 4, 2), (16, 512, 4, 2), (16, 512, 8, 2), (32, 256, 4, 2), (32, 512, 4, 1)]
        grid += [(16, 1024, 4, 1), (16, 128, 4, 4), (64, 256, 4, 2)]
    return [LinearConfig(*c) for c in grid]


BEST: dict[str, list[int]] = {}  # "block_m,n,k" -> the fastest config: see --configs-out


SWEEP: list[list[object]] = []  # rows of the sweep table (the best three per product and row count)


def product_row(name: str, rows: int, sweep: bool) -> list[object]:
    n, k, prologue = SHAPES[name]
    layers = product_inputs(n, k, prologue, rows)

    def torch_layers() -> None:
        for inputs in layers:
            decode_linear_reference(inputs["x"], inputs["w"], **kwargs_of(inputs, prologue))  # type: ignore[arg-type]

    def ours(config: LinearConfig | None) -> Callable[[], None]:
        def run() -> None:
            for inputs in layers:
                decode_linear(inputs["x"], inputs["w"], config=config, **kwargs_of(inputs, prologue))  # type: ignore[arg-type]

        return run

    first = layers[0]
    kwargs = kwargs_of(first, prologue)
    got = decode_linear(first["x"], first["w"], **kwargs)  # type: ignore[arg-type]
    exact = decode_linear_reference(
        first["x"].double(),
        first["w"].double(),
        **{k: v.double() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},  # type: ignore[arg-type]
    )
    torch_bf16 = decode_linear_reference(first["x"], first["w"], **kwargs)  # type: ignore[arg-type]

    def rel(t: torch.Tensor) -> float:
        return float((t.double() - exact).norm() / exact.norm())

    t_torch = graph_us(torch_layers, 1) / LAYERS
    silu = prologue.endswith("silu")
    default = linear_config(n, k, rows, prologue.startswith("norm"), silu)
    t_ours = graph_us(ours(None), 1) / LAYERS
    if sweep:
        timed = []
        for config in sweep_configs(rows):
            try:
                timed.append((graph_us(ours(config), 1) / LAYERS, config))
            except Exception as error:  # e.g. out of shared memory: not a candidate
                print(f"{name} rows {rows} {config}: {type(error).__name__}", file=sys.stderr)
        timed.sort(key=lambda tc: tc[0])
        for t, c in timed[:3]:
            SWEEP.append([name, rows, f"{c.block_n}/{c.block_k}/{c.warps}/{c.stages}", t])
            print(f"sweep: {name} rows {rows} {c}: {t:.2f} us", flush=True)
        if timed:
            best = timed[0][1]
            key = f"{block_m(rows, silu)},{n},{k}"
            BEST[key] = [best.block_n, best.block_k, best.warps, best.stages]
    weight_us = n * k * 2 / 4.0e12 * 1e6  # at 4 TB/s
    config = f"{default.block_n}/{default.block_k}/{default.warps}/{default.stages}"
    return [name, rows, t_torch, t_ours, t_torch / t_ours, weight_us, rel(torch_bf16), rel(got), config]


def attention_row(rows: int, length: int) -> list[object]:
    bf16 = torch.bfloat16
    layers = []
    for _ in range(LAYERS):
        cache = torch.randn(2, rows, HKV, length + 1, D, device="cuda").to(bf16)
        q = torch.randn(rows, HQ, D, device="cuda").to(bf16)
        positions = torch.randint(length // 2, length, (rows,), device="cuda")
        bias = torch.zeros(rows, 1, length, device="cuda", dtype=bf16)
        bias = bias.masked_fill(torch.arange(length, device="cuda") > positions[:, None, None], float("-inf"))
        layers.append((q, cache[0, :, :, :length], cache[1, :, :, :length], positions, bias.repeat_interleave(HKV, 0)))

    def torch_attention() -> None:  # the generator's eager decode attention: baddbmm with the mask, softmax, bmm
        for q, k, v, _, bias in layers:
            batch = rows * HKV
            scores = torch.baddbmm(
                bias, q.view(batch, HQ // HKV, D), k.reshape(batch, -1, D).transpose(1, 2), alpha=D**-0.5
            )
            torch.bmm(scores.softmax(-1), v.reshape(batch, -1, D))

    def ours() -> None:
        for q, k, v, positions, _ in layers:
            decode_attention(q, k, v, positions, D**-0.5)

    q, k, v, positions, _ = layers[0]
    exact = decode_attention_reference(q.double(), k.double(), v.double(), positions, D**-0.5)
    err = float((decode_attention(q, k, v, positions, D**-0.5).double() - exact).norm() / exact.norm())
    t_torch, t_ours = graph_us(torch_attention, 1) / LAYERS, graph_us(ours, 1) / LAYERS
    return ["attention", rows, length, t_torch, t_ours, t_torch / t_ours, err]


def heads_row(rows: int) -> list[object]:
    bf16 = torch.bfloat16
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, device="cuda").to(bf16)
    caches = [torch.zeros(rows, HKV, 2049, D, device="cuda", dtype=bf16) for _ in range(2)]
    positions = torch.randint(0, 2048, (rows,), device="cuda")
    angle = torch.rand(rows, 1, D, device="cuda") * 100
    tables = (angle.cos().to(bf16), angle.sin().to(bf16))
    norms = {
        "q_norm": torch.rand(D, device="cuda").to(bf16),
        "k_norm": torch.rand(D, device="cuda").to(bf16),
        "eps": 1e-6,
    }
    args = (qkv, *caches, positions, *tables)
    t_torch = graph_us(lambda: decode_heads_reference(*args, num_heads=HQ, num_kv_heads=HKV, **norms), LAYERS)  # type: ignore[arg-type]
    t_ours = graph_us(lambda: decode_heads(*args, num_heads=HQ, num_kv_heads=HKV, **norms), LAYERS)  # type: ignore[arg-type]
    return ["heads pass", rows, t_torch, t_ours, t_torch / t_ours]


def sampler_row(rows: int, vocab: int = 151_936) -> list[object]:
    logits = (4 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    index = torch.arange(rows, device="cuda")
    params = RowParams(
        torch.ones(rows, device="cuda"), 0 * index, torch.ones(rows, device="cuda"), index, index % 2 == 0, False
    )
    u = torch.rand(rows, device="cuda", dtype=torch.float64)

    def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return u

    want, got = sample(logits, params, index, uniform), sample_kernels(logits, params, index, uniform)
    same = bool(torch.equal(want.tokens, got.tokens))
    diff = float((want.logprobs - got.logprobs).abs().max())
    t_torch = graph_us(lambda: sample(logits, params, index, uniform), 1)
    t_ours = graph_us(lambda: sample_kernels(logits, params, index, uniform), 1)
    return ["sampler", rows, t_torch, t_ours, t_torch / t_ours, same, diff]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time a few launch configurations of decode_linear")
    parser.add_argument(
        "--configs-out",
        help="with --sweep: write the fastest configurations here (JSON), for THUNDERSYNC_DECODE_LINEAR_CONFIGS",
    )
    parser.add_argument("--rows", default="1,8,64", help="comma-separated row counts")
    args = parser.parse_args()
    print(header("decode layer kernels"), flush=True)
    print(markdown_table(["graph of", "us per kernel"], floor_table()), flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    sampler = [sampler_row(r) for r in rows]
    columns = ["pass", "rows", "eager us/step", "ours us/step", "speed-up", "same tokens", "max |d log-prob|"]
    print(markdown_table(columns, sampler), flush=True)
    heads = [heads_row(r) for r in rows]
    print(markdown_table(["pass", "rows", "torch us/layer", "ours us/layer", "speed-up"], heads), flush=True)
    attention = [attention_row(r, n) for r in rows for n in (256, 1024, 2048)]
    columns = ["pass", "rows", "keys", "torch us/layer", "ours us/layer", "speed-up", "ours rel err (fp64)"]
    print(markdown_table(columns, attention), flush=True)
    table = []
    for name in SHAPES:
        for r in rows:
            table.append(product_row(name, r, args.sweep))
            print("row:", table[-1], flush=True)
    columns = ["product", "rows", "torch us/layer", "ours us/layer", "speed-up", "weights at 4 TB/s us"]
    columns += ["torch bf16 rel err", "ours rel err", "config (N/K/warps/stages)"]
    print(markdown_table(columns, table))
    if SWEEP:
        print(markdown_table(["product", "rows", "config (N/K/warps/stages)", "us/layer"], SWEEP))
    if args.configs_out and BEST:
        Path(args.configs_out).write_text(json.dumps(BEST, indent=1))
        print(f"fastest configurations written to {args.configs_out}")


if __name__ == "__main__":
    main()
