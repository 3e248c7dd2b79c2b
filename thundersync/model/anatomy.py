"""Find the submodules of a transformers decoder-only causal LM that the engine calls itself.

The engine never uses transformers' KV-cache API (it changes between releases); it calls the
model's own modules: the embedding, per layer the norms, the q/k/v/o projections (with Qwen3's
per-head ``q_norm``/``k_norm`` when present), the MLP, the final norm, the rotary embedding and
the head. The layout is the one transformers uses for Qwen3, Qwen2 and Llama::

    causal_lm.model.embed_tokens                 causal_lm.model.layers[i].input_layernorm
    causal_lm.model.norm                         causal_lm.model.layers[i].self_attn.{q,k,v,o}_proj
    causal_lm.model.rotary_emb                   causal_lm.model.layers[i].self_attn.{q,k}_norm (Qwen3)
    causal_lm.lm_head                            causal_lm.model.layers[i].post_attention_layernorm, .mlp

A peft model is unwrapped with ``get_base_model()``; its wrapped Linear layers apply their
adapters when called, so LoRA needs nothing special.

The per-layer math over these parts is :mod:`thundersync.model.decoder`.

    >>> anatomy = decoder_anatomy(model)        # doctest: +SKIP
    >>> anatomy.num_kv_heads, anatomy.head_dim  # doctest: +SKIP
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thundersync.errors import ConfigError

__all__ = [
    "DecoderAnatomy",
    "LayerParts",
    "adapter_lock",
    "decoded_across_steps",
    "decoder_anatomy",
    "input_embedding_weight",
    "mark_decoded_across_steps",
    "unwrap_peft",
]

_DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@dataclass(frozen=True)
class LayerParts:
    """The callable parts of one decoder layer (``q_norm``/``k_norm`` are ``None`` outside Qwen3)."""

    input_norm: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    post_norm: nn.Module
    mlp: nn.Module


@dataclass(frozen=True)
class DecoderAnatomy:
    """The callable parts of a decoder and its attention geometry."""

    model: nn.Module  # the module the user gave (possibly peft-wrapped)
    embed: nn.Module
    layers: tuple[LayerParts, ...]
    norm: nn.Module
    rotary: nn.Module
    head: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the embedding: valid token ids are 0 .. vocab_size - 1
    scaling: float

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the hidden states (the embedding's weight dtype)."""
        weight = getattr(self.embed, "weight", None)
        return weight.dtype if isinstance(weight, torch.Tensor) else next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters with ``requires_grad``, in the model's registration order (no duplicates)."""
        return [p for p in self.model.parameters() if p.requires_grad]


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft ``PeftModel`` (the model itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


_ADAPTER_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.Lock] = weakref.WeakKeyDictionary()
_ADAPTER_LOCKS_GUARD = threading.Lock()


def adapter_lock(model: nn.Module) -> threading.Lock:
    """The one lock of ``model`` (a peft model, or any module) for work that must not see another
    thread switch its adapter: peft's ``disable_adapter()`` turns the adapter off for the whole
    module, so a GRPO KL reference scored that way (the policy, adapter off) holds it for the call,
    and a :class:`~thundersync.generation.TorchGenerator` over the same module holds it for each
    batcher step (it would otherwise sample from the base model meanwhile)."""
    with _ADAPTER_LOCKS_GUARD:
        lock = _ADAPTER_LOCKS.get(model)
        if lock is None:
            lock = _ADAPTER_LOCKS[model] = threading.Lock()
        return lock


_DECODED_ACROSS_STEPS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def mark_decoded_across_steps(model: nn.Module) -> None:
    """Record that a generator over ``model`` (the module :func:`adapter_lock` keys) keeps decoding
    while the optimizer steps (partial rollouts, ``max_staleness >= 1``; it cannot be unmarked):
    from now on a :class:`~thundersync.stages.step.StreamingTrainer` over it waits for the device
    inside the lock, before and after its optimizer step."""
    with _ADAPTER_LOCKS_GUARD:
        _DECODED_ACROSS_STEPS.add(model)


def decoded_across_steps(model: nn.Module) -> bool:
    """Whether :func:`mark_decoded_across_steps` marked ``model``."""
    with _ADAPTER_LOCKS_GUARD:
        return model in _DECODED_ACROSS_STEPS


def input_embedding_weight(causal_lm: nn.Module) -> torch.Tensor:
    """The token-embedding matrix [V, H] of a transformers model (``get_input_embeddings()``, so also
    when peft wraps the embedding)."""
    get = getattr(causal_lm, "get_input_embeddings", None)
    weight = getattr(get() if callable(get) else None, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ConfigError(
            f"{type(causal_lm).__name__} has no input embedding matrix (get_input_embeddings().weight); "
            "pass a transformers causal LM"
        )
    return weight


def _module(owner: nn.Module, name: str) -> nn.Module:
    """``owner.<name>``, which the caller checked exists, as a module."""
    part = getattr(owner, name)
    if not isinstance(part, nn.Module):
        raise ConfigError(
            f"{type(owner).__name__}.{name} is a {type(part).__name__}, not a torch module; the engine "
            "supports the transformers layout of Qwen3, Qwen2 and Llama"
        )
    return part


def _layer_parts(index: int, layer: nn.Module) -> LayerParts:
    missing = [name for name in _LAYER_PARTS if not hasattr(layer, name)]
    attention = getattr(layer, "self_attn", None)
    missing += [
        f"self_attn.{name}" for name in _ATTENTION_PARTS if attention is not None and not hasattr(attention, name)
    ]
    if missing:
        raise ConfigError(
            f"decoder layer {index} ({type(layer).__name__}) lacks {', '.join(missing)}; the engine "
            "supports the transformers layout of Qwen3, Qwen2 and Llama"
        )
    attention = _module(layer, "self_attn")
    return LayerParts(
        input_norm=_module(layer, "input_layernorm"),
        q_proj=_module(attention, "q_proj"),
        k_proj=_module(attention, "k_proj"),
        v_proj=_module(attention, "v_proj"),
        o_proj=_module(attention, "o_proj"),
        q_norm=None if getattr(attention, "q_norm", None) is None else _module(attention, "q_norm"),
        k_norm=None if getattr(attention, "k_norm", None) is None else _module(attention, "k_norm"),
        post_norm=_module(layer, "post_attention_layernorm"),
        mlp=_module(layer, "mlp"),
    )


def _check_supported(config: object) -> None:
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    ):
        raise ConfigError(
            "sliding-window attention layers are not supported by the streaming engine; "
            "set config.use_sliding_window=False (Qwen3/Qwen2 default) or use full attention"
        )
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:
        raise ConfigError(f"final_logit_softcapping={softcap} is not supported by the streaming engine")


def decoder_anatomy(model: nn.Module) -> DecoderAnatomy:
    """The :class:`DecoderAnatomy` of a transformers causal LM, optionally wrapped by peft."""
    causal_lm = unwrap_peft(model)
    decoder = getattr(causal_lm, "model", None)
    if (
        decoder is None
        or not all(hasattr(decoder, name) for name in _DECODER_PARTS)
        or not hasattr(causal_lm, "lm_head")
    ):
        raise ConfigError(
            f"cannot find the decoder of {type(causal_lm).__name__}: expected `.model` with "
            f"{', '.join(_DECODER_PARTS)} and `.lm_head` (the transformers layout of Qwen3, Qwen2 and Llama)"
        )
    config: Any = causal_lm.config  # a transformers PretrainedConfig
    _check_supported(config)
    num_heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    first_attention = decoder.layers[0].self_attn
    return DecoderAnatomy(
        model=model,
        embed=decoder.embed_tokens,
        layers=tuple(_layer_parts(i, layer) for i, layer in enumerate(decoder.layers)),
        norm=decoder.norm,
        rotary=decoder.rotary_emb,
        head=_module(causal_lm, "lm_head"),
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        vocab_size=int(input_embedding_weight(causal_lm).shape[0]),  # also under peft wrappers
        scaling=float(getattr(first_attention, "scaling", head_dim**-0.5)),
    )
