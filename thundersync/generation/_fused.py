"""Concatenated projection weights for the decode step: one matrix product for q/k/v, one for gate/up.

With one or a few live sequences each projection of a decode step is a thin matrix product whose
launch costs about what reading its weights does; stacking the q/k/v weights (and the MLP's gate
and up weights) into one matrix makes three products one and two products one, with the same
values up to the rounding of the product::

    [q | k | v] = h [Wq; Wk; Wv]^T + [bq; bk; bv]          gate, up = chunk(h [Wg; Wu]^T, 2)

With ``interleave = b`` the gate/up stack alternates blocks of b rows, [Wg[0:b]; Wu[0:b]; Wg[b:2b];
...], so that a product kernel holding 2b output columns holds the gate and up values of the same
b features (the fused decode kernels compute the activation in the product's epilogue:
:mod:`~thundersync.generation._kernel_layers`); :func:`split_gate_up` undoes it.

A layer is fused only when its projections are plain ``nn.Linear`` modules (a peft adapter
wraps them, and then the layer runs through its modules) and its MLP is one of the
``down(act(gate(x)) * up(x))`` classes of ``decoder.PLAIN_MLPS``. The stacked weights are a copy:
:meth:`FusedWeights.refresh` rewrites them in place (so captured CUDA graphs read the new values)
and the batcher calls it whenever its :class:`~thundersync.generation._weights_watch.WeightsWatch`
sees the parameters change. The copy costs :attr:`FusedWeights.nbytes` of device memory, about
two thirds of the decoder layers' weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from thundersync.model.anatomy import DecoderAnatomy, LayerParts
from thundersync.model.decoder import PLAIN_MLPS, apply_norm, apply_rotary

__all__ = ["FusedLayer", "FusedWeights", "fused_attention_inputs", "fused_attention_output", "split_gate_up"]


class _PlainMLP(Protocol):
    """What the MLPs of ``decoder.PLAIN_MLPS`` hold."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear

    def act_fn(self, x: torch.Tensor) -> torch.Tensor: ...


def _is_plain_mlp(module: nn.Module) -> TypeGuard[_PlainMLP]:
    return type(module).__name__ in PLAIN_MLPS and all(
        type(getattr(module, name, None)) is nn.Linear for name in ("gate_proj", "up_proj", "down_proj")
    )


def _plain_linears(modules: tuple[nn.Module, ...]) -> list[nn.Linear] | None:
    linears = [m for m in modules if type(m) is nn.Linear]
    return linears if len(linears) == len(modules) else None


def _stacked(sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([t.detach() for t in sources])


@dataclass(frozen=True)
class FusedLayer:
    """One layer's stacked weights and the parameters they copy."""

    qkv_weight: torch.Tensor  # [Hq * D + 2 * Hkv * D, H]
    qkv_bias: torch.Tensor | None  # [Hq * D + 2 * Hkv * D]
    gate_up_weight: torch.Tensor  # [2 * I, H]
    q_size: int  # Hq * D; k and v have Hkv * D each
    sources: tuple[tuple[torch.Tensor, ...], ...]  # what each of the three stacks, in order
    interleave: int = 0  # of the gate/up stack (see the module docstring); 0: [Wg; Wu]

    def refresh(self) -> None:
        """Copy the current parameter values into the stacked weights (in place)."""
        targets = (self.qkv_weight, self.qkv_bias, self.gate_up_weight)
        for target, sources in zip(targets, self.sources, strict=True):
            if target is None:
                continue
            if target is self.gate_up_weight and self.interleave:
                _write_interleaved(target, sources, self.interleave)
            else:
                torch.cat([t.detach() for t in sources], out=target)


def _write_interleaved(target: torch.Tensor, sources: tuple[torch.Tensor, ...], block: int) -> None:
    gate, up = sources
    blocks = target.view(gate.shape[0] // block, 2, block, gate.shape[1])
    blocks[:, 0].copy_(gate.detach().view(blocks[:, 0].shape))
    blocks[:, 1].copy_(up.detach().view(blocks[:, 1].shape))


def split_gate_up(gate_up: torch.Tensor, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) [N, I] of the product [N, 2 I] with a gate/up stack interleaved by ``interleave`` rows."""
    if not interleave:
        size = gate_up.shape[-1] // 2
        return gate_up[:, :size], gate_up[:, size:]
    blocks = gate_up.view(gate_up.shape[0], -1, 2, interleave)
    return blocks[:, :, 0].reshape(gate_up.shape[0], -1), blocks[:, :, 1].reshape(gate_up.shape[0], -1)


def fuse_layer(parts: LayerParts, interleave: int = 0) -> FusedLayer | None:
    """The stacked weights of ``parts``, or None when its modules are not plain (see the module docstring)."""
    projections = _plain_linears((parts.q_proj, parts.k_proj, parts.v_proj))
    mlp = parts.mlp
    if projections is None or not _is_plain_mlp(mlp) or mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
        return None
    biases = tuple(m.bias for m in projections if m.bias is not None)
    if len(biases) not in (0, 3):
        return None
    weights = tuple(m.weight for m in projections)
    gate_up = (mlp.gate_proj.weight, mlp.up_proj.weight)
    if interleave and mlp.gate_proj.out_features % interleave:
        return None
    if interleave:
        gate_up_weight = gate_up[0].new_empty(2 * gate_up[0].shape[0], gate_up[0].shape[1])
        _write_interleaved(gate_up_weight, gate_up, interleave)
    else:
        gate_up_weight = _stacked(gate_up)
    return FusedLayer(
        qkv_weight=_stacked(weights),
        qkv_bias=_stacked(biases) if biases else None,
        gate_up_weight=gate_up_weight,
        q_size=projections[0].out_features,
        sources=(weights, biases, gate_up),
        interleave=interleave,
    )


class FusedWeights:
    """The stacked weights of every layer of ``anatomy`` that can be fused (``None`` for the others),
    the gate/up stacks interleaved by ``interleave`` rows (0: not; see the module docstring)."""

    def __init__(self, anatomy: DecoderAnatomy, interleave: int = 0) -> None:
        with torch.no_grad():
            self.layers = [fuse_layer(parts, interleave) for parts in anatomy.layers]

    def refresh(self) -> None:
        """Copy the current parameters into every stacked weight (call after the weights change)."""
        with torch.no_grad():
            for layer in self.layers:
                if layer is not None:
                    layer.refresh()

    @property
    def nbytes(self) -> int:
        tensors = [
            t
            for layer in self.layers
            if layer is not None
            for t in (layer.qkv_weight, layer.qkv_bias, layer.gate_up_weight)
        ]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _heads(proj: torch.Tensor, norm: nn.Module | None, head_dim: int) -> torch.Tensor:
    shaped = proj.view(proj.shape[0], -1, head_dim)
    return apply_norm(norm, shaped) if norm is not None else shaped


def fused_attention_inputs(
    parts: LayerParts,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    q_size: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~thundersync.model.decoder.attention_inputs` with one product for q, k and v."""
    h = apply_norm(parts.input_norm, x)
    qkv = F.linear(h, qkv_weight, qkv_bias)
    kv_size = (qkv.shape[-1] - q_size) // 2
    q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
    q = apply_rotary(_heads(q, parts.q_norm, head_dim), cos, signed_sin)
    k = apply_rotary(_heads(k, parts.k_norm, head_dim), cos, signed_sin)
    return q, k, _heads(v, None, head_dim)


def fused_attention_output(
    parts: LayerParts, gate_up_weight: torch.Tensor, x: torch.Tensor, a: torch.Tensor, interleave: int = 0
) -> torch.Tensor:
    """:func:`~thundersync.model.decoder.attention_output` with one product for gate and up.

    The residual adds are written ``(x.float() + y.float()).to(x.dtype)``: the same values (torch
    adds 16-bit tensors in fp32 and rounds once), but inductor then fuses the add into the next
    norm instead of folding it into the product as cuBLAS's ``addmm``, which copies the residual
    first, slower than the plain product for one row (bench/RESULTS.md, section "2026-12-02 —
    Where a decode step's time goes; pinned slot changes; the sampler's scan; the residual adds
    (seventh session)")."""
    o_proj: torch.Tensor = parts.o_proj(a)
    x = _residual(x, o_proj)
    gate, up = split_gate_up(F.linear(apply_norm(parts.post_norm, x), gate_up_weight), interleave)
    mlp = cast(_PlainMLP, parts.mlp)  # fuse_layer fuses plain MLPs only
    out: torch.Tensor = mlp.down_proj(mlp.act_fn(gate) * up)
    return _residual(x, out)


def _residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y``, computed in fp32 and rounded once to ``x``'s dtype."""
    return (x.float() + y.float()).to(x.dtype)
