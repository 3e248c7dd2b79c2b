"""The fixed cost of one pack: forward+backward through the adapter, eager and compiled layers side by side.

    python bench/engine_pack.py            # H200: Qwen3-0.6B-shaped, bf16, 28 layers
    python bench/engine_pack.py --tiny     # the same on CPU with a tiny model, in seconds

A small pack (one OPD action of 64-512 tokens) costs far more than its arithmetic: every eager op
of every layer pays a fixed host cost. Each row times ``forward_pack`` + backward of one pack after
a 512-token prefix (a detached proxy that requires grad, as the engine builds it), median of 5
after warm-up, synchronized, with the layers' math in two forms:

- ``eager``: :data:`thundersync.model.decoder.EAGER`, op by op;
- ``compiled``: :data:`thundersync.engine.accel._compiled.COMPILED` (``torch.compile`` of a layer up to
  attention and after it, rows dynamic; opt-in). Its compile happens in ``pack_math``, before the
  timing;
- ``layer graphs``: :mod:`thundersync.engine.accel._layer_graphs` (each layer's two parts replayed as CUDA
  graphs, rows padded to a power of two; attention eager). Its captures happen in the warm-up calls;
- ``fused``: :data:`thundersync.engine.accel._fused.FUSED` (the norms, per-head norms and rotary, and the
  MLP's activation as fused Triton kernels, forward and backward; CUDA, 16-bit; in the pack graph
  the key gather too);
- ``pack graph``: :mod:`thundersync.engine.accel._pack_graphs` (the whole pack, attention included, one
  graph forward and one backward per bucket) of the eager math; ``pack graph, fused`` of the fused
  math (the default on CUDA). "-" where the pack fits no bucket (it then runs ungraphed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import header, markdown_table, median_seconds
from bench.engine import make_model
from thundersync.engine.accel import _layer_graphs as _graphed
from thundersync.engine.accel import _pack_graphs as _pack_graph
from thundersync.engine.accel._compiled import pack_math
from thundersync.engine.accel._fused import FUSED
from thundersync.engine.accel._layer_graphs import GraphedLayers, graphed_layers
from thundersync.engine.accel._pack_graphs import PackGraphs, pack_graphs
from thundersync.model import anatomy
from thundersync.model import packed as adapter
from thundersync.model.decoder import EAGER, LayerMath
from thundersync.model.packed import ChunkSpec, forward_pack


def make_prefix(an: anatomy.DecoderAnatomy, vocab: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A prompt's per-layer K/V state, detached proxies that require grad."""
    tokens = torch.randint(0, vocab, (length,), device=an.device)
    with torch.no_grad():
        out = forward_pack(an, [ChunkSpec(tokens, 0, adapter.empty_prefix(an))])
    return [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in out.kv(0)]


def pack_step(an: anatomy.DecoderAnatomy, chunks: list[ChunkSpec], form: LayerMath | str) -> Callable[[], None] | None:
    """One pack's forward and backward with the layer math ``form``, or "layers" (the layer graphs),
    "pack" (the pack graph), "fused pack" or "compiled pack" (the pack graph of the fused or the
    compiled math); None where the pack graph refuses the pack."""
    rows = sum(int(c.tokens.numel()) for c in chunks)
    whole = form in ("pack", "fused pack", "compiled pack")
    if whole and isinstance(_pack_graph.plan(chunks), str):
        return None

    def run() -> None:
        owner: PackGraphs | GraphedLayers | None = None
        if whole:
            owner = pack_graphs(an, True)
            assert owner is not None, "the pack graphs need CUDA"
            graphed = {"compiled pack": pack_math(an, True), "fused pack": FUSED}.get(str(form), EAGER)
            out = owner.forward(chunks, graphed)
            assert out is not None, f"the pack graph refused the pack: {_graphed.graph_counts()}"
        else:
            owner = graphed_layers(an, True) if form == "layers" else None
            math = owner.math(rows) if owner is not None else form
            out = forward_pack(an, chunks, math if isinstance(math, LayerMath) else EAGER)
        out.hidden.float().pow(2).mean().backward()
        if owner is not None:
            owner.release()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (seconds)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the table, profile one 64-token pack in each form: ops and kernels by count and host time",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    model = make_model(args.tiny, device, torch.bfloat16 if cuda else torch.float32)
    model.requires_grad_(True)
    an = anatomy.decoder_anatomy(model)
    vocab = an.vocab_size
    prefix_len = 512 if cuda else 32
    sizes = (64, 256, 1024) if cuda else (8, 32)
    prefix = make_prefix(an, vocab, prefix_len)

    def chunk(length: int) -> ChunkSpec:
        return ChunkSpec(torch.randint(0, vocab, (length,), device=device), prefix_len, prefix)

    cases = [(f"1 chunk of {n} after P={prefix_len}", [chunk(n)]) for n in sizes]
    cases.append((f"8 chunks of {sizes[1]} after P={prefix_len}", [chunk(sizes[1]) for _ in range(8)]))
    cases.append((f"32 chunks of {sizes[0]} after P={prefix_len}", [chunk(sizes[0]) for _ in range(32)]))
    forms: dict[str, LayerMath | str] = {"eager": EAGER, "compiled": pack_math(an, True)}
    if cuda:
        forms |= {"fused": FUSED, "layer graphs": "layers", "pack graph": "pack"}
        forms |= {"pack graph, fused": "fused pack", "pack graph, compiled": "compiled pack"}
    rows = []
    for label, chunks in cases:
        ms: dict[str, float | str] = {}
        for name, form in forms.items():
            step = pack_step(an, chunks, form)
            ms[name] = "-" if step is None else 1e3 * median_seconds(step, cuda=cuda)
            model.zero_grad(set_to_none=True)
        best = min((v for v in ms.values() if isinstance(v, float)), default=float("nan"))
        tokens = sum(int(c.tokens.numel()) for c in chunks)
        rows.append([label, tokens, *ms.values(), f"{float(ms['eager']) / best:.2f}x"])
    layers = len(an.layers)
    print(header("python bench/engine_pack.py" + (" --tiny" if args.tiny else "")))
    print(
        f"model: {layers} layers, hidden {model.config.hidden_size}, dtype {an.dtype}; forward+backward of one pack\n"
    )
    print(markdown_table(["pack", "tokens", *(f"{name} ms" for name in forms), "best speed-up"], rows))
    print(f"\ngraph counts: {_graphed.graph_counts()}")
    if args.profile:
        for name, form in forms.items():
            step = pack_step(an, cases[0][1], form)
            if step is not None:
                print(f"\n{name}, {cases[0][0]}:")
                profile(step, cuda)


def profile(step: Callable[[], None], cuda: bool) -> None:
    """One profiled pack step (after a warm-up): where the host time goes, op by op."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch_profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    ops = sum(e.count for e in events if e.key.startswith("aten::") and e.device_type.name == "CPU")
    print(f"\nprofile of one pack step: {ops} aten op calls (nested calls included), {kernels} CUDA kernels\n")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    if cuda:
        print(events.table(sort_by="self_device_time_total", row_limit=12))


if __name__ == "__main__":
    main()
