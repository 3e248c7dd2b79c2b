"""Tiny random causal LMs built in code (no download) for the engine and GRPO tests."""

from __future__ import annotations

import torch


class _NativeRMSNorm(torch.nn.Module):
    """Qwen3's RMSNorm computed in the input's dtype.

    transformers' Qwen3RMSNorm casts to fp32, which limits an fp64 model to fp32 accuracy (then no
    fp64 comparison can go below ~1e-7). Same formula: w * x / sqrt(mean(x^2) + eps).
    """

    weight: torch.nn.Parameter
    variance_epsilon: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def tiny_qwen3(
    dtype: torch.dtype = torch.float32, *, seed: int = 0, tie: bool = False, layers: int = 2
) -> torch.nn.Module:
    """A 2-layer Qwen3 with hidden 32, head_dim 16, GQA (4 query / 2 kv heads), vocab 97."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",  # eager softmax is fp32 even in fp64
    )
    model = Qwen3ForCausalLM(config).to(dtype)
    if dtype == torch.float64:
        use_native_norms(model)
    with torch.no_grad():  # random norms, so a wrong norm placement cannot hide behind ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def use_native_norms(model: torch.nn.Module) -> None:
    """Swap every Qwen3RMSNorm of ``model`` for :class:`_NativeRMSNorm` (same weights, same formula)."""
    for module in model.modules():
        if type(module).__name__ == "Qwen3RMSNorm":
            module.__class__ = _NativeRMSNorm


def with_lora(model: torch.nn.Module, *, seed: int = 1) -> torch.nn.Module:
    """``model`` wrapped by peft LoRA on the attention and MLP projections, with non-zero B."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    )
    wrapped = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return wrapped.eval()
