"""Find the submodules of a decoder-only causal LM that the generator calls itself.

A private stand-in until the engine's model adapter is shared: it knows the layout that
transformers uses for Qwen3, Qwen2 and Llama (``model.embed_tokens``, ``model.layers[i].self_attn.
{q,k,v,o}_proj`` with optional ``q_norm``/``k_norm``, ``model.norm``, ``model.rotary_emb``,
``lm_head``) and unwraps a peft model, whose wrapped Linear layers then apply their adapters when
called. Nothing here touches transformers' KV-cache API.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from thundersync.errors import ConfigError

__all__ = ["DecoderAnatomy", "decoder_anatomy"]


@dataclass(frozen=True)
class DecoderAnatomy:
    """The callable parts of a decoder and the attention geometry."""

    embed: nn.Module
    layers: tuple[nn.Module, ...]
    norm: nn.Module
    rotary: nn.Module
    head: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    scaling: float

    @property
    def dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.head.parameters()).device


def _unwrap(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


def decoder_anatomy(model: nn.Module) -> DecoderAnatomy:
    """The :class:`DecoderAnatomy` of a transformers causal LM (optionally peft-wrapped)."""
    causal_lm = _unwrap(model)
    decoder = getattr(causal_lm, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or not all(hasattr(decoder, n) for n in needed):
        raise ConfigError(
            f"cannot find the decoder of {type(causal_lm).__name__}: expected `.model` with "
            f"{', '.join(needed)} (the transformers layout of Qwen3, Qwen2 and Llama)"
        )
    config = causal_lm.config
    if getattr(config, "use_sliding_window", False):
        raise ConfigError("sliding-window attention is not supported by TorchGenerator")
    attention = decoder.layers[0].self_attn
    num_heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    return DecoderAnatomy(
        embed=decoder.embed_tokens,
        layers=tuple(decoder.layers),
        norm=decoder.norm,
        rotary=decoder.rotary_emb,
        head=causal_lm.lm_head,
        num_heads=num_heads,
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=head_dim,
        vocab_size=int(config.vocab_size),
        scaling=float(getattr(attention, "scaling", head_dim**-0.5)),
    )
