"""Merged export of a peft LoRA model: a plain model loaded with it computes the same logits."""

from __future__ import annotations

import pytest
import torch

from thundersync.generation._peft_weights import merged_weights


def test_merged_weights_reproduce_the_lora_model(make_qwen3) -> None:
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(make_qwen3(seed=1), peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "down_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    plain = make_qwen3(seed=2)
    missing, unexpected = plain.load_state_dict(dict(merged_weights(lora)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    tokens = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, lora(tokens).logits, atol=1e-5, rtol=1e-5)
        with lora.disable_adapter():
            assert not torch.allclose(plain(tokens).logits, lora(tokens).logits, atol=1e-3)
