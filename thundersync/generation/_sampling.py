"""Sampling on the device with counter-based random numbers.

Every draw uses one uniform number ``u = U(seed, position)`` computed by hashing the request's seed
and the absolute position of the token being sampled. The random numbers of a sequence therefore
depend only on its own seed, not on which other sequences share the batch, nor on whether its
prefix was cached or recomputed; its logits can still differ in their last bits with those (see
:mod:`thundersync.generation.torch_generator`).

A token is drawn by inverting the CDF of the sampling distribution

    p = softmax(mask_{top-k, top-p}(z / T)),     y = min { i : sum_{j <= i} p_j > u * sum_j p_j }

where top-k keeps the k largest entries of ``z / T`` and top-p keeps the smallest prefix of the
tokens sorted by probability whose mass reaches ``top_p`` (the token that crosses it included).
The sums are fp64, taken block by block (:func:`inverse_cdf`). Greedy rows (``T = 0``) take
``argmax z``. :func:`sample_kernels` draws the same tokens in two Triton kernels when no row
filters (:func:`~thundersync.kernels.decode.decode_sample`), where :func:`sample` launches some
sixty small kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["RowParams", "SampleOutput", "counter_uniform", "inverse_cdf", "sample", "sample_kernels"]

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _hash(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    h = _fmix32((positions & _M32) ^ (0x9E3779B9 * (stream + 1) & _M32))
    h = _fmix32(h ^ (seeds & _M32))
    return _fmix32(h ^ ((seeds >> 32) & _M32) ^ 0x68E31DA4)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A uniform float64 in [0, 1) for each (seed, position) pair, with 53 random bits.

    ``seeds`` and ``positions`` are int64 tensors of the same shape (seeds in [0, 2^63)).
    """
    high = _hash(seeds, positions, 0) >> 5  # 27 bits
    low = _hash(seeds, positions, 1) >> 6  # 26 bits
    return (high * (1 << 26) + low).to(torch.float64) / float(1 << 53)


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as device tensors of shape [R]."""

    temperature: torch.Tensor  # float32 or float64 (cast to the logits' dtype before dividing)
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32, 1 = off
    seed: torch.Tensor  # int64
    sampling_logprobs: torch.Tensor  # bool: behaviour log-prob under the sampling distribution
    filtered: bool  # any row with top-k or top-p active


@dataclass(frozen=True)
class SampleOutput:
    tokens: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] float32 (float64 for fp64 logits), the behaviour log-probs


def _filter(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scaled`` [R, V] with the entries outside top-k / top-p set to -inf."""
    ordered, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    drop = (top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None])
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = drop | (mass_before >= top_p[:, None])
    drop[:, 0] = False  # the most likely token always stays
    mask = torch.zeros_like(drop).scatter_(-1, order, drop)
    return scaled.masked_fill(mask, float("-inf"))


_BLOCK = 1024  # vocabulary entries per block of inverse_cdf


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` [R, V] (fp64, unnormalized), ``min { i : sum_{j <= i} p_j > u * sum_j p_j }``
    for ``u`` [R] in [0, 1); never an entry of zero probability.

    The sums are taken block by block: the blocks' masses, their running sum, the block that
    holds the draw, then the running sum inside it. A running sum along a whole [R, V] row is one
    thread block's serial walk in torch's scan kernel for R > 1, far slower than the device-wide
    scan of one row (bench/RESULTS.md, section "2026-12-02 — Where a decode step's time goes;
    pinned slot changes; the sampler's scan; the residual adds (seventh session)"); these are
    short rows."""
    rows, vocab = probs.shape
    blocks = -(-vocab // _BLOCK)
    padded = torch.nn.functional.pad(probs, (0, blocks * _BLOCK - vocab)).view(rows, blocks, _BLOCK)
    mass = padded.sum(dim=-1)  # [R, blocks]
    ends = mass.cumsum(dim=-1)
    target = (u * ends[:, -1])[:, None]
    # rounding can put the draw past a running sum's end: then the last entry that has mass
    block = torch.minimum(torch.searchsorted(ends, target, right=True), _last_nonzero(mass))  # [R, 1]
    before = torch.where(block > 0, ends.gather(-1, (block - 1).clamp_(min=0)), 0.0)
    inner = padded.gather(1, block[:, :, None].expand(rows, 1, _BLOCK))[:, 0]  # [R, BLOCK]
    index = torch.searchsorted(before + inner.cumsum(dim=-1), target, right=True)
    return (block * _BLOCK + torch.minimum(index, _last_nonzero(inner)))[:, 0]


def _last_nonzero(values: torch.Tensor) -> torch.Tensor:
    """[R, 1]: the last index of each row of ``values`` [R, N] that holds a nonzero (0 if none)."""
    return (torch.arange(values.shape[-1], device=values.device) * (values > 0)).amax(dim=-1, keepdim=True)


def sample(
    logits: torch.Tensor,
    params: RowParams,
    positions: torch.Tensor,
    uniform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = counter_uniform,
) -> SampleOutput:
    """Draw one token per row of ``logits`` [R, V] for the tokens at ``positions`` [R].

    The math is fp32, fp64 for fp64 ``logits`` (an fp64 model's): the temperature division, the
    filters and both log-softmaxes.

    ``uniform`` is :func:`counter_uniform` or a compiled form of it (its ~30 integer operations
    are one kernel then)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    model_logprobs = logits.log_softmax(dim=-1)
    greedy = params.temperature == 0.0
    scaled = logits / torch.where(greedy, 1.0, params.temperature).to(logits.dtype)[:, None]
    if params.filtered:
        scaled = _filter(scaled, params.top_k, params.top_p)
    sampling_logprobs = scaled.log_softmax(dim=-1)
    drawn = inverse_cdf(sampling_logprobs.exp().to(torch.float64), uniform(params.seed, positions))
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    chosen = tokens[:, None]
    sampled_lp = torch.where(greedy, 0.0, sampling_logprobs.gather(-1, chosen)[:, 0])
    model_lp = model_logprobs.gather(-1, chosen)[:, 0]
    return SampleOutput(tokens, torch.where(params.sampling_logprobs, sampled_lp, model_lp))


def sample_kernels(
    logits: torch.Tensor,
    params: RowParams,
    positions: torch.Tensor,
    uniform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = counter_uniform,
) -> SampleOutput:
    """:func:`sample` through :func:`~thundersync.kernels.decode.decode_sample` when no row uses
    top-k/top-p (the same tokens unless a draw falls within rounding of a boundary of the
    cumulative distribution; log-probs to fp32 rounding), else :func:`sample` itself."""
    if params.filtered:
        return sample(logits, params, positions, uniform)
    from thundersync.kernels.decode import decode_sample

    u = uniform(params.seed, positions)
    tokens, logprobs = decode_sample(logits, params.temperature, u, params.sampling_logprobs)
    return SampleOutput(tokens, logprobs)
