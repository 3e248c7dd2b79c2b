"""The decode step's fused layer kernels, with their pure-torch references.

A decode step multiplies a few rows by each weight matrix, so every product is bound by reading
its weights, and the small kernels between the products (norms, activation, residual adds,
per-head norms, rotary, cache writes) cost as much launch and tail latency as the products.
Three kernels of ours and cuBLAS's two attention products take a layer into seven launches::

    qkv = decode_linear(x, W_qkv, norm=input_norm)             # RMS norm + product (+ bias)
    q = decode_heads(qkv, k_cache, v_cache, positions, ...)    # per-head norms, rotary, cache write
    attn = decode_attention(q, keys, values, positions, ...)    # q.k, masked softmax, p.v
    x = decode_linear(attn, W_o, residual=x)                    # product + residual
    act = decode_linear(x, W_gate_up, norm=post_norm, silu_mul=True)  # RMS norm + product + silu(gate) * up
    x = decode_linear(act, W_down, residual=x)                  # product + residual

Each rounds where the eager layer rounds (see ``_decode_triton``), so they compute the eager
values up to the order of the products' fp32 sums; the ``*_reference`` functions are those eager
forms. :func:`decode_sample` draws the step's tokens in two kernels, as the eager sampler
(:func:`~thundersync.generation._sampling.sample`) draws them in some sixty.
:func:`decode_kernels_capability` probes the four once per (device, dtype) against them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from thundersync.errors import ConfigError
from thundersync.kernels.probe import Capability, check_close, probe, record

__all__ = [
    "GATE_UP_INTERLEAVE",
    "LinearConfig",
    "decode_attention",
    "decode_attention_reference",
    "decode_heads",
    "decode_heads_reference",
    "decode_kernels_capability",
    "decode_linear",
    "decode_linear_reference",
    "decode_sample",
    "decode_sample_reference",
    "linear_config",
    "tuned_linear_configs",
    "use_linear_configs",
]

_KERNEL = "decode_layer"
GATE_UP_INTERLEAVE = 16  # rows of a gate/up stack's blocks for decode_linear(..., silu_mul=True)


@dataclass(frozen=True)
class LinearConfig:
    """Launch parameters of :func:`decode_linear` (see :func:`linear_config`)."""

    block_n: int
    block_k: int
    warps: int
    stages: int


def linear_config(n: int, k: int, rows: int, norm: bool, silu_mul: bool = False) -> LinearConfig:
    """The launch parameters of an [rows, k] x [k, n] product: from the JSON file in use
    (:func:`tuned_linear_configs`: ``Acceleration.decode_linear_configs`` /
    ``THUNDERSYNC_DECODE_LINEAR_CONFIGS``) when it lists ("block_m,n,k": [block_n, block_k, warps,
    stages], as ``bench/decode_layer.py --sweep --configs-out`` writes it), else the fastest of the
    sweeps at Qwen3-0.6B's shapes (bench/RESULTS.md, sections "2026-12-02 — Fused decode-layer
    kernels (eighth session): 546 -> 288 kernels, batch 1 3.92 -> 3.19 ms, long tail 6.61 -> 6.16 s"
    and "2026-12-02 — The host-time changes measured, and the sampler in two kernels (ninth session):
    batch-1 step 1.30 ms, long tail 4.92 s"): one row in registers, whole 1,024 inputs per step
    over eight warps; on tensor cores with the norm, whose operand is computed in registers and
    stalls every loop step on its loads, few long steps; without, short steps pipelined four
    (three) deep."""
    size = block_m(rows, silu_mul)
    tuned = tuned_linear_configs().get(f"{size},{n},{k}")
    if tuned is not None:
        return tuned
    if size == 1:
        return LinearConfig(16, 1024, 8, 1)
    if rows > 16:
        return LinearConfig(32, 256, 4, 2) if norm else LinearConfig(32, 128, 4, 3)
    return LinearConfig(32, 512, 4, 1) if norm else LinearConfig(16, 128, 4, 4)


_configs_path: list[str] = []  # the file in use, once set or read


def use_linear_configs(path: str) -> None:
    """Take :func:`decode_linear`'s tuned launch configurations from the JSON file ``path`` from now
    on ("": none; a generator does this with its ``Acceleration.decode_linear_configs``)."""
    if path:
        _read_configs(path)  # a bad file fails here, naming it
    _configs_path[:] = [path]


def tuned_linear_configs() -> dict[str, LinearConfig]:
    """The configurations of the file in use (:func:`use_linear_configs`; until it is called, the one
    ``THUNDERSYNC_DECODE_LINEAR_CONFIGS`` names, read once; none when unset); ConfigError, saying
    what is wrong, for a file that is not one."""
    if not _configs_path:
        _configs_path.append(os.environ.get("THUNDERSYNC_DECODE_LINEAR_CONFIGS", ""))
    return _read_configs(_configs_path[0]) if _configs_path[0] else {}


@functools.cache
def _read_configs(path: str) -> dict[str, LinearConfig]:
    def fail(why: str) -> ConfigError:
        return ConfigError(
            f"THUNDERSYNC_DECODE_LINEAR_CONFIGS={path!r}: {why}; it must hold a JSON object of "
            '"block_m,n,k": [block_n, block_k, warps, stages] (bench/decode_layer.py --sweep --configs-out '
            "writes one); unset it or fix the file"
        )

    try:
        configs = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise fail(str(error)) from error
    if not isinstance(configs, dict):
        raise fail(f"a JSON {type(configs).__name__}, not an object")
    tuned = {}
    for key, value in configs.items():
        if len(key.split(",")) != 3 or not all(part.strip().isdigit() for part in key.split(",")):
            raise fail(f"key {key!r} is not three integers")
        if not (isinstance(value, list) and len(value) == 4 and all(type(v) is int and v > 0 for v in value)):
            raise fail(f"{key}: {value!r} is not four positive integers")
        block_n, block_k, warps, _ = value
        if any(v < 16 or v & (v - 1) for v in (block_n, block_k)) or warps & (warps - 1):
            raise fail(f"{key}: {value!r} needs block_n and block_k powers of two >= 16 and warps a power of two")
        tuned[",".join(part.strip() for part in key.split(","))] = LinearConfig(*value)
    return tuned


def block_m(rows: int, silu_mul: bool = False) -> int:
    """The rows one program of :func:`decode_linear` covers: 1 for a single row (its products and
    sums in registers: no tensor-core tile of 16 rows staged through shared memory), else 16, 32 or
    64. The gate/up product with its activation stays on tensor cores at one row too. Measured
    per product (bench/RESULTS.md, section "2026-12-02 — The host-time changes measured, and the
    sampler in two kernels (ninth session): batch-1 step 1.30 ms, long tail 4.92 s"): registers
    won at one row for the q/k/v, o and down products, lost for gate/up and lost at four rows."""
    if rows == 1 and not silu_mul:
        return 1
    return min(64, max(16, 1 << (rows - 1).bit_length()))


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """``norm?(x) @ weight.T (+ bias) (+ residual)`` of ``x`` [M, K] with ``weight`` [N, K]
    (contiguous in K), the RMS norm with ``norm_weight`` (and ``eps``) when given.

    ``silu_mul``: ``weight`` is a gate/up stack interleaved by :data:`GATE_UP_INTERLEAVE` rows
    (:func:`~thundersync.generation._fused.split_gate_up`), and the result is ``silu(gate) * up``
    [M, N / 2]; no bias or residual then.
    """
    from thundersync.kernels._decode_triton import linear_kernel

    m = x.shape[0]
    n, k = weight.shape
    if x.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"decode_linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    cfg = config or linear_config(n, k, m, norm_weight is not None, silu_mul)
    if silu_mul:
        if bias is not None or residual is not None or n % (2 * GATE_UP_INTERLEAVE):
            raise ValueError(f"decode_linear: silu_mul takes an interleaved gate/up weight, got {tuple(weight.shape)}")
        cfg = dataclasses.replace(cfg, block_n=2 * GATE_UP_INTERLEAVE)
    out = torch.empty(m, n // 2 if silu_mul else n, dtype=weight.dtype, device=x.device)
    rows_per_program = block_m(m, silu_mul)
    grid = (-(-n // cfg.block_n), -(-m // rows_per_program))
    linear_kernel[grid](
        x,
        weight,
        out,
        bias if bias is not None else out,
        residual if residual is not None else out,
        norm_weight if norm_weight is not None else out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        residual.stride(0) if residual is not None else 0,
        eps,
        NORM=norm_weight is not None,
        HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None,
        SILU_MUL=silu_mul,
        DOT=rows_per_program > 1,
        BLOCK_M=rows_per_program,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return out


def decode_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`decode_linear` as the eager layer computes it."""
    if norm_weight is not None:
        x = norm_weight * F.rms_norm(x, (x.shape[-1],), None, eps)
    out = F.linear(x, weight, bias)
    if silu_mul:
        blocks = out.view(out.shape[0], -1, 2, GATE_UP_INTERLEAVE)
        out = F.silu(blocks[:, :, 0]) * blocks[:, :, 1]
        return out.reshape(x.shape[0], -1)
    if residual is not None:
        out = (residual.float() + out.float()).to(out.dtype)
    return out


def decode_heads(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """The queries [M, Hq, D] of a stacked q/k/v product ``qkv`` [M, (Hq + 2 Hkv) D], after the
    per-head norms (when given) and the rotary embedding; row r's key (normed, rotated) and value
    are written into ``k_cache``/``v_cache`` [slots, Hkv, L, D] at slot r, position ``positions[r]``.

    ``cos``, ``signed_sin``: [M, 1, D] or [M, D], as :func:`~thundersync.model.decoder.rotary_tables` gives them.
    """
    from thundersync.kernels._decode_triton import heads_kernel

    m = qkv.shape[0]
    d = k_cache.shape[-1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or qkv.stride(1) != 1:
        raise ValueError(f"decode_heads: qkv {tuple(qkv.shape)} is not [rows, (Hq + 2 Hkv) * D] with D = {d}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("decode_heads: give both per-head norms or neither")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("decode_heads: the key and value caches must share a layout, contiguous in D")
    q = torch.empty(m, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    cos2, sin2 = cos.reshape(m, d), signed_sin.reshape(m, d)
    heads_kernel[(m, num_heads + num_kv_heads)](
        qkv,
        q,
        k_cache,
        v_cache,
        positions,
        cos2,
        sin2,
        q_norm if q_norm is not None else q,
        k_norm if k_norm is not None else q,
        qkv.stride(0),
        q.stride(0),
        cos2.stride(0),
        sin2.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        eps,
        HQ=num_heads,
        HKV=num_kv_heads,
        D=d,
        NORM=q_norm is not None,
        num_warps=1,
    )
    return q


def decode_heads_reference(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """:func:`decode_heads` as the eager layer computes it."""
    m, d = qkv.shape[0], k_cache.shape[-1]
    q, k, v = torch.split(qkv.view(m, -1, d), [num_heads, num_kv_heads, num_kv_heads], dim=1)
    if q_norm is not None and k_norm is not None:
        q = q_norm * F.rms_norm(q, (d,), None, eps)
        k = k_norm * F.rms_norm(k, (d,), None, eps)
    cos, signed_sin = cos.reshape(m, 1, d), signed_sin.reshape(m, 1, d)

    def rotary(t: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(t * cos, t.roll(d // 2, dims=-1), signed_sin)

    q, k = rotary(q), rotary(k)
    rows = torch.arange(m, device=qkv.device)
    k_cache[rows, :, positions] = k
    v_cache[rows, :, positions] = v
    return q


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One query per row: ``q`` [R, Hq, D] over ``keys``/``values`` [R, Hkv, L, D] (views of a
    cache), row r seeing keys 0 .. ``positions[r]``; returns [R, Hq * D].

    Three kernels: the scores' product, one pass for the scaling, the mask and the softmax (fp32,
    rounded once), the values' product."""
    from thundersync.kernels._decode_triton import softmax_kernel

    rows, heads, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    batch = rows * kv_heads
    scores = torch.bmm(q.reshape(batch, heads // kv_heads, d), keys.reshape(batch, length, d).transpose(1, 2))
    probs = torch.empty_like(scores)
    block = min(1024, 1 << (length - 1).bit_length())
    softmax_kernel[(rows * heads,)](scores, probs, positions, length, scaling, ROWS_PER_SLOT=heads, BLOCK=block)
    return torch.bmm(probs, values.reshape(batch, length, d)).view(rows, heads * d)


def decode_attention_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scaling: float
) -> torch.Tensor:
    """:func:`decode_attention` as grouped-query attention with a mask, the softmax in fp32."""
    rows, heads, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    k = keys.repeat_interleave(heads // kv_heads, dim=1)  # [R, Hq, L, D]
    v = values.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("rhd,rhld->rhl", q.float(), k.float()) * scaling
    visible = torch.arange(length, device=q.device)[None, None, :] <= positions[:, None, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(q.dtype)
    return torch.einsum("rhl,rhld->rhd", probs.float(), v.float()).to(q.dtype).reshape(rows, heads * d)


SAMPLE_BLOCK = 4096  # vocabulary entries per program of decode_sample's first kernel


def decode_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    u: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    *,
    block: int = SAMPLE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [R] int64, log-probs [R] fp32) of :func:`~thundersync.generation._sampling.sample`
    for rows without top-k/top-p: ``logits`` [R, V], ``temperature`` [R] fp32 (0: greedy), ``u``
    [R] fp64 in [0, 1), ``sampling_logprobs`` [R] bool (the log-prob under the sampling
    distribution, else the model's).

    Two kernels where the eager sampler launches some sixty: per block of ``block`` entries its
    max, first argmax and two sums of exponentials; then per row the normalizers, the block that
    holds ``u * total`` and the entry inside it (fp64 running sums, as the eager sampler takes
    them), the greedy argmax and the token's log-prob. The token is the eager sampler's unless u
    falls within rounding of a boundary of the cumulative distribution."""
    from thundersync.kernels._decode_triton import sample_blocks_kernel, sample_draw_kernel

    rows, vocab = logits.shape
    if logits.stride(1) != 1 or vocab >= 1 << 24 or block & (block - 1):
        raise ValueError(f"decode_sample: logits {tuple(logits.shape)} (stride {logits.stride()}), block {block}")
    blocks = -(-vocab // block)
    padded = max(2, 1 << (blocks - 1).bit_length())  # the second kernel's vector of blocks
    stats = torch.empty(rows, 4, padded, dtype=torch.float32, device=logits.device)
    sample_blocks_kernel[(rows, blocks)](logits, temperature, stats, vocab, logits.stride(0), NBP=padded, BLOCK=block)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    sample_draw_kernel[(rows,)](
        logits,
        temperature,
        u,
        sampling_logprobs,
        stats,
        tokens,
        logprobs,
        vocab,
        blocks,
        logits.stride(0),
        NBP=padded,
        BLOCK=block,
        num_warps=8,
    )
    return tokens, logprobs


def decode_sample_reference(
    logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, sampling_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_sample` in plain torch: softmaxes over whole rows, one fp64 running sum per row."""
    z = logits.float()
    greedy = temperature == 0.0
    model = z.log_softmax(-1)
    scaled = (z / torch.where(greedy, 1.0, temperature)[:, None]).log_softmax(-1)
    ends = scaled.exp().double().cumsum(-1)
    drawn = torch.searchsorted(ends, (u * ends[:, -1])[:, None], right=True)[:, 0].clamp_max(z.shape[-1] - 1)
    tokens = torch.where(greedy, z.argmax(-1), drawn)
    sampled = torch.where(greedy, 0.0, scaled.gather(-1, tokens[:, None])[:, 0])
    return tokens, torch.where(sampling_logprobs, sampled, model.gather(-1, tokens[:, None])[:, 0])


def _trial(device: torch.device, dtype: torch.dtype) -> None:
    """Every kernel against its reference at a small shape with every option."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    x, w = rand(3, 256), rand(96, 256)
    options: tuple[dict[str, Any], ...] = (
        {"norm_weight": rand(256), "eps": 1e-6, "bias": rand(96)},
        {"residual": rand(3, 96)},
        {"norm_weight": rand(256), "eps": 1e-6, "silu_mul": True},
    )
    for kwargs in options:
        for rows in (3, 1):  # one row: the products in registers (the gate/up product's on tensor cores)
            args = {k: v[:rows] if k == "residual" else v for k, v in kwargs.items()}
            got, want = decode_linear(x[:rows], w, **args), decode_linear_reference(x[:rows], w, **args)
            check_close(got, want, 2e-2, f"{rows} rows")
    heads, kv_heads, d = 4, 2, 64
    qkv = rand(3, (heads + 2 * kv_heads) * d)
    caches = [torch.zeros(4, kv_heads, 8, d, dtype=dtype, device=device) for _ in range(4)]
    positions = torch.tensor([5, 0, 7], device=device)
    angle = torch.rand(3, 1, d, generator=gen, device=device)
    tables = (angle.cos().to(dtype), angle.sin().to(dtype))
    norms = {"q_norm": rand(d), "k_norm": rand(d), "eps": 1e-6}
    got = decode_heads(qkv, caches[0], caches[1], positions, *tables, num_heads=heads, num_kv_heads=kv_heads, **norms)  # type: ignore[arg-type]
    want = decode_heads_reference(
        qkv,
        caches[2],
        caches[3],
        positions,
        *tables,
        num_heads=heads,
        num_kv_heads=kv_heads,
        **norms,  # type: ignore[arg-type]
    )
    check_close(got, want, 2e-2, "queries")
    check_close(caches[0], caches[2], 2e-2, "keys")
    check_close(caches[1], caches[3], 0.0, "values")
    keys, values = caches[0][:3, :, :8], caches[1][:3, :, :8]
    check_close(
        decode_attention(got, keys, values, positions, 0.125),
        decode_attention_reference(got, keys, values, positions, 0.125),
        2e-2,
        "attention",
    )
    _trial_sample(device, dtype, gen)


def _trial_sample(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> None:
    """decode_sample against its reference: the same tokens, log-probs to fp32 rounding."""
    rows, vocab = 4, 1000
    logits = (3 * torch.randn(rows, vocab, generator=gen, device=device)).to(dtype)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3], device=device)
    flags = torch.tensor([True, False, False, True], device=device)
    u = torch.tensor([0.1, 0.5, 0.999, 0.3], dtype=torch.float64, device=device)
    want_tokens, want_logprobs = decode_sample_reference(logits, temperature, u, flags)
    tokens, logprobs = decode_sample(logits, temperature, u, flags, block=256)
    check_close(tokens.float(), want_tokens.float(), 0.0, "sampled tokens")
    check_close(logprobs, want_logprobs, 1e-4, "sampled log-probs")


def decode_kernels_capability(device: torch.device, dtype: torch.dtype) -> Capability:
    """Whether :func:`decode_linear` and :func:`decode_heads` run on ``device`` for ``dtype`` (a
    16-bit dtype on CUDA with triton installed, after a trial against the references), and why not."""
    if dtype not in (torch.bfloat16, torch.float16):
        return record(_KERNEL, device, dtype, "decode", False, f"{dtype} is not a 16-bit dtype")
    if device.type != "cuda":
        return record(_KERNEL, device, dtype, "decode", False, "Triton kernels run on CUDA devices only")
    if importlib.util.find_spec("triton") is None:
        return record(
            _KERNEL, device, dtype, "decode", False, "triton is not installed: pip install 'thundersync[kernels]'"
        )
    return probe(_KERNEL, device, dtype, "decode", lambda: _trial(device, dtype))
