"""Cases for the Triton kernels under ``TRITON_INTERPRET=1`` (CPU) against their pure-torch counterparts.

Not collected on its own: ``test_triton_interpreted.py`` runs this file in a fresh interpreter with
the variable set, because Triton picks the interpreter when functions are decorated (its own
library included) and other code in the test process (e.g. torch.profiler) imports triton first.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from thundersync.kernels._logprobs_core import LinearLogprobs
from thundersync.kernels._logprobs_torch import TorchRowOps


@pytest.fixture(scope="module")
def interpreted() -> ModuleType:
    """``thundersync.kernels._logprobs_triton``, imported with the interpreter on."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_triton_interpreted.py"
    return importlib.import_module("thundersync.kernels._logprobs_triton")


def _assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@settings(max_examples=5, deadline=None)
@given(
    n=st.integers(1, 6),
    width=st.integers(1, 9),
    vocab=st.integers(2, 2600),
    train_head=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_triton_logprob_rows_match_the_torch_rows(
    interpreted: ModuleType, n: int, width: int, vocab: int, train_head: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, width, generator=gen) * 2
    w = torch.randn(vocab, width, generator=gen)
    y = torch.randint(0, vocab, (n,), generator=gen)
    g = torch.randn(2, n, generator=gen)
    results = []
    for ops in (interpreted.TritonRowOps(), TorchRowOps()):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_(train_head)
        lp, ent = LinearLogprobs.apply(hh, ww, y, True, ops, True)
        ((lp * g[0]).sum() + (ent * g[1]).sum()).backward()
        results.append([lp, ent, hh.grad] + ([ww.grad] if train_head else []))
    _assert_all_close(results[0], results[1], 2e-4)  # fp32 sums over the vocabulary, in another order


# --- the decode step's layer kernels (thundersync.kernels.decode) ---

DTYPES = {"fp32": (torch.float32, 2e-6), "fp16": (torch.float16, 3e-3)}  # fp16: the products' sums in another order


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


@settings(max_examples=12, deadline=None)
@given(
    # 1: products in registers (but silu_mul); 70: two programs of 64 rows
    m=st.sampled_from([1, 2, 3, 5, 16, 17, 40, 70]),
    n=st.integers(1, 70),
    k=st.integers(1, 150),
    norm=st.booleans(),
    epilogue=st.sampled_from(["none", "bias", "residual", "bias+residual", "silu_mul"]),
    dtype=st.sampled_from(sorted(DTYPES)),
    config=st.sampled_from([(16, 64, 4, 2), (32, 32, 2, 3), (64, 128, 4, 1)]),
    seed=st.integers(0, 2**31),
)
@example(m=70, n=33, k=100, norm=True, epilogue="bias+residual", dtype="fp32", config=(16, 64, 4, 2), seed=1)
@example(m=70, n=40, k=100, norm=True, epilogue="silu_mul", dtype="fp16", config=(16, 64, 4, 2), seed=2)
@example(m=1, n=40, k=100, norm=True, epilogue="silu_mul", dtype="fp16", config=(16, 64, 4, 2), seed=3)
@example(m=1, n=33, k=150, norm=True, epilogue="bias+residual", dtype="fp32", config=(32, 32, 2, 3), seed=4)
def test_decode_linear_matches_its_reference(
    m: int, n: int, k: int, norm: bool, epilogue: str, dtype: str, config: tuple, seed: int
) -> None:
    from thundersync.kernels.decode import GATE_UP_INTERLEAVE, LinearConfig, decode_linear, decode_linear_reference

    torch_dtype, tol = DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch_dtype)

    if epilogue == "silu_mul":
        n = 2 * GATE_UP_INTERLEAVE * (1 + n % 3)
    kwargs: dict[str, object] = {
        "bias": rand(n) if "bias" in epilogue else None,
        "residual": rand(m, n) if "residual" in epilogue else None,
        "silu_mul": epilogue == "silu_mul",
    }
    if norm:
        kwargs.update(norm_weight=rand(k), eps=1e-5)
    x, w = rand(m, k), rand(n, k)
    got = decode_linear(x, w, config=LinearConfig(*config), **kwargs)  # type: ignore[arg-type]
    assert got.dtype == torch_dtype and got.shape == (m, n // 2 if epilogue == "silu_mul" else n)
    assert _rel(got, decode_linear_reference(x, w, **kwargs)) <= tol  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("norms", [True, False])
def test_decode_heads_match_their_reference_and_write_only_each_rows_position(dtype: str, norms: bool) -> None:
    from thundersync.kernels.decode import decode_heads, decode_heads_reference

    torch_dtype, tol = DTYPES[dtype]
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, rows = 4, 2, 16, 3
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen).to(torch_dtype)
    stores = [
        torch.randn(2, 5, kv_heads, 9, d, generator=gen).to(torch_dtype) for _ in range(2)
    ]  # [layers, slots, ...]
    expected = [s.clone() for s in stores]
    positions = torch.tensor([4, 0, 8])
    angle = torch.rand(rows, 1, d, generator=gen) * 7
    tables = (angle.cos().to(torch_dtype), angle.sin().to(torch_dtype))
    kwargs = (
        {
            "q_norm": torch.rand(d, generator=gen).to(torch_dtype) + 0.5,
            "k_norm": torch.rand(d, generator=gen).to(torch_dtype),
            "eps": 1e-6,
        }
        if norms
        else {}
    )
    shape = {"num_heads": heads, "num_kv_heads": kv_heads}
    got = decode_heads(qkv, stores[0][1], stores[1][1], positions, *tables, **shape, **kwargs)  # type: ignore[arg-type]
    want = decode_heads_reference(qkv, expected[0][1], expected[1][1], positions, *tables, **shape, **kwargs)  # type: ignore[arg-type]
    assert _rel(got, want) <= tol
    assert _rel(stores[0], expected[0]) <= tol
    assert torch.equal(stores[1], expected[1])  # values are copied
    untouched = torch.ones(2, 5, kv_heads, 9, dtype=torch.bool)
    untouched[1, torch.arange(rows), :, positions] = False
    assert torch.equal(stores[0][untouched], expected[0][untouched])


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_kernel_layers_decode_like_the_eager_layers(family: str) -> None:
    """The whole decode step's layers, fp32 under the interpreter, against the eager layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from thundersync.generation._forward import Rows, forward_hidden
    from thundersync.generation._fused import FusedWeights
    from thundersync.generation._kernel_layers import KernelLayers
    from thundersync.generation._kv_cache import KVCache
    from thundersync.kernels.decode import GATE_UP_INTERLEAVE
    from thundersync.model.anatomy import decoder_anatomy
    from thundersync.model.decoder import EAGER

    shape = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **shape)).eval()
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias)
    anatomy = decoder_anatomy(model)
    caches = [KVCache(anatomy, slots=3, capacity=12) for _ in range(2)]
    for cache in caches:
        for store in (cache.k, cache.v):
            store.copy_(torch.randn(store.shape, generator=torch.Generator().manual_seed(5)))
    tokens, positions = torch.tensor([3, 9, 60]), torch.tensor([2, 7, 0])
    rows = Rows(slots=None, positions=positions[:, None], pad_index=None, unpad_index=None, key_len=8)
    with torch.no_grad():
        want = forward_hidden(anatomy, caches[0], tokens, positions, torch.arange(3), rows)
        fused = FusedWeights(anatomy, interleave=GATE_UP_INTERLEAVE)
        got = KernelLayers(anatomy, fused).forward(anatomy, caches[1], tokens, positions, 8, EAGER)
    assert _rel(got, want) <= 1e-5
    assert _rel(caches[1].k, caches[0].k) <= 1e-6
    assert _rel(caches[1].v, caches[0].v) <= 1e-6
    new = torch.zeros(caches[0].k.shape, dtype=torch.bool)
    new[:, torch.arange(3), :, positions] = True
    assert torch.equal(caches[1].k[~new], caches[0].k[~new])  # only the decoded tokens' keys are written


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("length", [5, 40, 1500])  # 1500: the softmax walks its keys in two blocks
def test_decode_attention_matches_its_reference_over_cache_views(dtype: str, length: int) -> None:
    from thundersync.kernels.decode import decode_attention, decode_attention_reference

    torch_dtype, tol = DTYPES[dtype]
    gen = torch.Generator().manual_seed(length)
    rows, heads, kv_heads, d = 3, 4, 2, 16
    cache = torch.randn(2, 4, kv_heads, length + 7, d, generator=gen).to(torch_dtype)  # [k/v, slots, Hkv, capacity, D]
    q = torch.randn(rows, heads, d, generator=gen).to(torch_dtype)
    positions = torch.tensor([length - 1, 0, length // 2])
    keys, values = cache[0, :rows, :, :length], cache[1, :rows, :, :length]
    want = decode_attention_reference(q, keys, values, positions, 0.3)
    assert _rel(decode_attention(q, keys, values, positions, 0.3), want) <= tol


def _unfiltered(temperature: torch.Tensor, flags: torch.Tensor) -> Any:
    """RowParams of rows without top-k/top-p (imported here: the interpreter must be on first)."""
    from thundersync.generation._sampling import RowParams

    rows = temperature.shape[0]
    zeros = torch.zeros(rows, dtype=torch.long)
    return RowParams(temperature, zeros, torch.ones(rows), torch.arange(rows) * 7919 + 1, flags, False)


@pytest.mark.parametrize(
    ("vocab", "block", "dtype", "seed"),
    [(1000, 256, "fp16", 0), (5000, 1024, "fp32", 1), (4096, 512, "fp16", 2), (900, 1024, "fp32", 3)],
)
def test_decode_sample_draws_the_eager_samplers_tokens(vocab: int, block: int, dtype: str, seed: int) -> None:
    from thundersync.generation._sampling import counter_uniform, sample
    from thundersync.kernels.decode import decode_sample, decode_sample_reference

    gen = torch.Generator().manual_seed(seed)
    rows = 24
    scale = torch.rand(rows, 1, generator=gen) * 8 + 0.5  # flat to peaked distributions
    logits = (scale * torch.randn(rows, vocab, generator=gen)).to(DTYPES[dtype][0])
    temperature = torch.tensor([0.0, 1.0, 0.05, 2.5, 0.7, 1.0] * 4)
    flags = torch.rand(rows, generator=gen) < 0.5
    positions = torch.randint(0, 10_000, (rows,), generator=gen)
    params = _unfiltered(temperature, flags)
    want = sample(logits, params, positions)
    u = counter_uniform(params.seed, positions)
    tokens, logprobs = decode_sample(logits, temperature, u, flags, block=block)
    assert torch.equal(tokens, want.tokens)
    torch.testing.assert_close(logprobs, want.logprobs, rtol=0, atol=2e-5)
    plain_tokens, plain_logprobs = decode_sample_reference(logits, temperature, u, flags)  # whole-row sums
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logprobs, plain_logprobs, rtol=0, atol=2e-5)


def test_decode_sample_breaks_ties_and_keeps_draws_at_the_ends_on_tokens_with_mass() -> None:
    from thundersync.generation._sampling import sample
    from thundersync.kernels.decode import decode_sample

    vocab, block = 700, 128
    logits = torch.full((5, vocab), -30.0)
    logits[0, [5, 300, 650]] = 4.0  # greedy: the first of three equal maxima, in different blocks
    logits[1, [130, 131]] = 0.0  # u = 0: the first token with mass
    logits[2, [10, 690]] = 0.0  # u just below 1: the last token with mass, in the last (partial) block
    logits[3, :] = torch.linspace(-5, 5, vocab)
    logits[[1, 2]] = logits[[1, 2]].masked_fill(logits[[1, 2]] < -1, float("-inf"))  # entries without mass
    logits[4] = float("-inf")
    logits[4, [600, 601]] = torch.tensor([-50.0, -40.0])  # greedy past blocks without mass, far below 0
    temperature = torch.tensor([0.0, 1.0, 1.0, 0.3, 0.0])
    flags = torch.tensor([False, True, True, False, False])
    u = torch.tensor([0.5, 0.0, 1.0 - 2.0**-53, 0.25, 0.5], dtype=torch.float64)
    want = sample(logits, _unfiltered(temperature, flags), torch.zeros(5, dtype=torch.long), lambda s, p: u)
    tokens, logprobs = decode_sample(logits, temperature, u, flags, block=block)
    assert tokens.tolist() == want.tokens.tolist()
    assert tokens[[0, 1, 2, 4]].tolist() == [5, 130, 690, 601]
    torch.testing.assert_close(logprobs, want.logprobs, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_the_decode_kernels_probe_trial_passes(dtype: str) -> None:
    from thundersync.kernels.decode import _trial

    _trial(torch.device("cpu"), DTYPES[dtype][0])  # raises AssertionError naming what differs


# --- a training layer's fused kernels (thundersync.kernels.layer) and the engine's math over them ---


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize(
    ("width", "heads", "head_dim", "rows"),
    # 17 rows: 3 to a backward program (at most 8 here), 6 programs, the last with 2; 6 partial sums in tiles of 4
    [(96, 3, 16, 5), (64, 4, 8, 1), (40, 2, 32, 17)],
)
def test_the_layer_kernels_match_their_references(
    monkeypatch: pytest.MonkeyPatch, dtype: str, width: int, heads: int, head_dim: int, rows: int
) -> None:
    from thundersync.kernels import layer

    monkeypatch.setattr(layer, "_MAX_PROGRAMS", 8)  # strips of several rows, the last one short
    monkeypatch.setattr(layer, "_SUM_ROWS", 4)  # their partial sums summed in tiles, the last one short
    layer._trial(torch.device("cpu"), DTYPES[dtype][0], width, heads, head_dim, rows)  # raises naming what differs


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_fused_pack_math_equals_the_eager_pack(family: str) -> None:
    """A pack of two chunks (one after a prefix) through the fused math against the eager math,
    fp32 under the interpreter: outputs, every parameter's gradient and the prefix's adjoint."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from thundersync.engine.accel._fused import FUSED
    from thundersync.model.anatomy import decoder_anatomy
    from thundersync.model.decoder import EAGER
    from thundersync.model.packed import ChunkSpec, forward_pack

    shape = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    config = Qwen3Config(**shape) if family == "qwen3" else LlamaConfig(**shape)
    model = (Qwen3ForCausalLM if family == "qwen3" else LlamaForCausalLM)(config)
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, 1.0, 0.3)  # norms that are not all ones
    anatomy = decoder_anatomy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    prefix = [(torch.randn(2, 5, 16), torch.randn(2, 5, 16)) for _ in range(2)]
    tokens = [torch.randint(0, 64, (7,)), torch.randint(0, 64, (4,))]

    def run(math: object) -> list[torch.Tensor]:
        leaves = [(k.clone().requires_grad_(), v.clone().requires_grad_()) for k, v in prefix]
        chunks = [ChunkSpec(tokens[0], 0, [(k[:, :0], v[:, :0]) for k, v in leaves]), ChunkSpec(tokens[1], 5, leaves)]
        out = forward_pack(anatomy, chunks, math)  # type: ignore[arg-type]
        seed = torch.Generator().manual_seed(3)
        loss = (out.hidden * torch.randn(out.hidden.shape, generator=seed)).sum()
        loss = loss + sum((k * torch.randn(k.shape, generator=seed)).sum() for k, _ in out.layer_kv)
        grads = torch.autograd.grad(loss, [*params, *(t for kv in leaves for t in kv)], allow_unused=True)
        used = [g for g in grads if g is not None]  # the head is not used
        assert len(used) == len(grads) - 1
        return [out.hidden.detach(), *(t.detach() for kv in out.layer_kv for t in kv), *used]

    for got, want in zip(run(FUSED), run(EAGER), strict=True):
        assert _rel(got, want) <= 2e-5


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_the_key_gather_equals_its_reference(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """Random keys over a prefix, the pack's own rows and the zero row, rows read several times or
    never, rows of three column blocks: the forward bitwise, the backward to the order of fp32 sums."""
    from thundersync.kernels import layer

    monkeypatch.setattr(layer, "_ROW_BLOCK", 16)  # a 2 x 20 row: three programs, the last one short
    gen = torch.Generator().manual_seed(5)
    p, r = 9, 6
    index = torch.randint(0, p + r + 1, (40,), generator=gen)  # p + r: the zero row
    order, starts = layer.key_readers(index, p + r)
    prefix = torch.randn(p, 2, 20, generator=gen).requires_grad_()
    own = torch.randn(r, 2, 20, generator=gen).to(DTYPES[dtype][0]).requires_grad_()
    got = layer.gather_rows(prefix, own, index, order, starts)
    want = layer.gather_rows_reference(prefix, own, index, order, starts)
    assert torch.equal(got, want)
    seed = torch.randn(got.shape, generator=gen).to(got.dtype)
    for g, w in zip(torch.autograd.grad(got, [prefix, own], seed), torch.autograd.grad(want, [prefix, own], seed)):
        assert g.dtype == w.dtype
        assert _rel(g, w) <= (1e-6 if g.dtype == torch.float32 else 1e-3)


def test_the_fused_pack_graph_body_equals_the_eager_body(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack graphs' body (the math they capture, run here uncaptured on CPU) from a plan's static
    inputs, fused against eager: two chunks read a shared prefix (its rows' adjoints sum two
    readers), one chunk starts a sequence, rows and keys padded to the bucket (buckets of at least
    16 rows and keys here, not 64 and 256: the interpreter's time goes with the padded rows)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from thundersync.engine.accel import _pack_graphs
    from thundersync.engine.accel._fused import FUSED
    from thundersync.engine.accel._pack_graphs import _Body, plan
    from thundersync.model.anatomy import decoder_anatomy
    from thundersync.model.decoder import EAGER
    from thundersync.model.packed import ChunkSpec

    shape = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape))
    anatomy = decoder_anatomy(model)
    params = [p for p in model.model.parameters() if p.requires_grad]
    source = [(torch.randn(2, 5, 16), torch.randn(2, 5, 16)) for _ in range(2)]
    empty = [(k[:, :0], v[:, :0]) for k, v in source]
    chunks = [
        ChunkSpec(torch.randint(0, 64, (7,)), 0, empty),
        ChunkSpec(torch.randint(0, 64, (4,)), 5, source),
        ChunkSpec(torch.randint(0, 64, (3,)), 5, source),
    ]
    monkeypatch.setattr(_pack_graphs, "MIN_ROWS", 16)
    monkeypatch.setattr(_pack_graphs, "_MIN_KEYS", 16)
    layout = plan(chunks)
    assert not isinstance(layout, str), layout
    assert layout.shape == (16, 16, 32, 7) and layout.rows == 14  # 2 padding rows, 5 of 16 prefix rows, 6 padding keys
    rows, p_rows = layout.shape[:2]
    ids = torch.zeros(rows, dtype=torch.long)
    ids[: layout.rows] = torch.cat([c.tokens for c in chunks])

    def run(math: object) -> list[torch.Tensor]:
        prefix = [torch.zeros(p_rows, 2, 16) for _ in range(4)]  # per layer keys then values [P, Hkv, D]
        for i, t in enumerate(prefix):
            t[:5] = source[i // 2][i % 2].transpose(0, 1)
        prefix = [t.requires_grad_() for t in prefix]
        out = _Body(anatomy, layout.shape, math)(ids, layout.io, *prefix)  # type: ignore[arg-type]
        seed = torch.Generator().manual_seed(3)
        n = layout.rows
        loss = sum((o[:n] * torch.randn(o[:n].shape, generator=seed)).sum() for o in out)
        grads = torch.autograd.grad(loss, [*params, *prefix])
        return [*(o[:n].detach() for o in out), *grads]

    for got, want in zip(run(FUSED), run(EAGER), strict=True):
        assert _rel(got, want) <= 2e-5
