"""The decode step's layers through the fused kernels of :mod:`thundersync.kernels.decode`.

Seven kernels per layer where the compiled layer math launches nineteen (norm, q/k/v product, two
per-head norm + rotary passes, two cache writes, mask copy, q.k, softmax, p.v, o-projection,
residual add + norm, gate/up product, activation, down product and its split-K reduction)::

    qkv = norm + product          (decode_linear: the input norm, the stacked q/k/v weight)
    q = heads pass                (decode_heads: per-head norms, rotary; k and v into the cache)
    a = attention                 (decode_attention: q.k, masked softmax, p.v over the cache)
    x = product + residual        (o-projection)
    act = norm + product + silu(gate) * up   (the gate/up stack interleaved by 16 rows)
    x = product + residual        (down projection)

The values are the compiled layer math's up to the order of the products' fp32 sums (each
kernel rounds where the eager layer rounds). A model qualifies when every layer is fused
(:mod:`._fused`), its norms are plain transformers RMSNorms, its MLP activation is SiLU, its
o-projection a plain ``nn.Linear``, its head dimension a power of two and its dtype 16-bit, and
the kernels pass their probe on the device (:func:`~thundersync.kernels.decode.decode_kernels_capability`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from thundersync.generation._fused import FusedLayer, FusedWeights
from thundersync.generation._kv_cache import KVCache
from thundersync.kernels.decode import (
    GATE_UP_INTERLEAVE,
    decode_attention,
    decode_heads,
    decode_kernels_capability,
    decode_linear,
    tuned_linear_configs,
)
from thundersync.model.anatomy import DecoderAnatomy, LayerParts
from thundersync.model.decoder import LayerMath, is_plain_rms_norm, is_silu_mlp

__all__ = ["KernelLayers"]


@dataclass(frozen=True)
class _Layer:
    """The tensors one layer's kernels read (the parameters themselves, so updates show)."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    input_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor
    eps: float  # of every norm of the layer

    @classmethod
    def of(cls, parts: LayerParts, fused: FusedLayer) -> _Layer:
        mlp = parts.mlp
        return cls(
            qkv_weight=fused.qkv_weight,
            qkv_bias=fused.qkv_bias,
            input_norm=_tensor(parts.input_norm, "weight"),
            q_norm=_tensor(parts.q_norm, "weight") if parts.q_norm is not None else None,
            k_norm=_tensor(parts.k_norm, "weight") if parts.k_norm is not None else None,
            o_weight=_tensor(parts.o_proj, "weight"),
            o_bias=getattr(parts.o_proj, "bias", None),
            post_norm=_tensor(parts.post_norm, "weight"),
            gate_up_weight=fused.gate_up_weight,
            down_weight=_tensor(_module(mlp, "down_proj"), "weight"),
            eps=_eps(parts.input_norm),
        )


def _module(owner: nn.Module, name: str) -> nn.Module:
    module = getattr(owner, name)
    assert isinstance(module, nn.Module), name
    return module


def _tensor(owner: nn.Module, name: str) -> torch.Tensor:
    tensor = getattr(owner, name)
    assert isinstance(tensor, torch.Tensor), name
    return tensor


def _why_not(anatomy: DecoderAnatomy, fused: FusedWeights) -> str | None:
    """Why ``anatomy`` cannot decode through the kernels, or None when it can (without the probe)."""
    if anatomy.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {anatomy.dtype} (the kernels take 16-bit weights)"
    d = anatomy.head_dim
    if d < 2 or d & (d - 1):
        return f"head_dim {d} is not a power of two"
    for index, (parts, layer) in enumerate(zip(anatomy.layers, fused.layers, strict=True)):
        norms = [parts.input_norm, parts.post_norm] + [n for n in (parts.q_norm, parts.k_norm) if n is not None]
        mlp = parts.mlp
        if layer is None:
            return f"layer {index} is not fused (peft adapters, another MLP, or not {GATE_UP_INTERLEAVE}-row gate/up blocks)"
        if not all(is_plain_rms_norm(n) for n in norms) or (parts.q_norm is None) != (parts.k_norm is None):
            return f"layer {index} has a norm other than a plain RMSNorm"
        if type(parts.o_proj) is not nn.Linear:
            return f"layer {index}'s o_proj is a {type(parts.o_proj).__name__}"
        if not is_silu_mlp(mlp) or _module(mlp, "down_proj").bias is not None:
            return f"layer {index}'s MLP is not SiLU-gated without a down bias"
        if len({_eps(n) for n in norms}) != 1:
            return f"layer {index}'s norms differ in eps"
    return None


class KernelLayers:
    """Every layer of a decode step through the fused kernels (see the module docstring)."""

    def __init__(self, anatomy: DecoderAnatomy, fused: FusedWeights) -> None:
        self.fused = fused  # refreshed by the batcher when the weights change
        self.layers = [
            _Layer.of(parts, layer)
            for parts, layer in zip(anatomy.layers, fused.layers, strict=True)
            if layer is not None  # every layer (checked by build)
        ]

    @classmethod
    def build(cls, anatomy: DecoderAnatomy) -> tuple[KernelLayers | None, str]:
        """The kernel layers of ``anatomy`` (their stacked weights in :attr:`fused`), or None and why
        not. ConfigError for a launch-configurations file (``Acceleration.decode_linear_configs``,
        ``THUNDERSYNC_DECODE_LINEAR_CONFIGS``) that is not one."""
        tuned_linear_configs()
        fused = FusedWeights(anatomy, interleave=GATE_UP_INTERLEAVE)
        why = _why_not(anatomy, fused)
        if why is None:
            capability = decode_kernels_capability(anatomy.device, anatomy.dtype)
            why = None if capability.ok else capability.why
        return (cls(anatomy, fused), "") if why is None else (None, why)

    def forward(
        self,
        an: DecoderAnatomy,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        key_len: int,
        math: LayerMath,
    ) -> torch.Tensor:
        """Hidden states [R, hidden] (before the final norm) of slots 0 .. R - 1 decoding ``tokens``
        at ``positions``; their keys and values enter ``cache``."""
        rows = tokens.shape[0]
        x, cos, sin = math.embed(an, tokens, positions)
        for index, layer in enumerate(self.layers):
            qkv = decode_linear(x, layer.qkv_weight, bias=layer.qkv_bias, norm_weight=layer.input_norm, eps=layer.eps)
            q = decode_heads(
                qkv,
                cache.k[index],
                cache.v[index],
                positions,
                cos,
                sin,
                num_heads=an.num_heads,
                num_kv_heads=an.num_kv_heads,
                q_norm=layer.q_norm,
                k_norm=layer.k_norm,
                eps=layer.eps,
            )
            keys, values = cache.read(index, rows, key_len)
            a = decode_attention(q, keys, values, positions, an.scaling)
            x = decode_linear(a, layer.o_weight, bias=layer.o_bias, residual=x)
            act = decode_linear(x, layer.gate_up_weight, norm_weight=layer.post_norm, eps=layer.eps, silu_mul=True)
            x = decode_linear(act, layer.down_weight, residual=x)
        return x


def _eps(norm: nn.Module) -> float:
    eps = norm.variance_epsilon
    assert isinstance(eps, float), type(eps)
    return eps
