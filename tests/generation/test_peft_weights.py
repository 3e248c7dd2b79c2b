"""Merged export of a peft LoRA model: a plain model loaded with it computes the same logits."""

from __future__ import annotations

import pytest
import torch

from thundersync.generation._peft_weights import merged_weights


def test_merged_weights_reproduce_the_lora_model(make_qwen3) -> None:
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(
        make_qwen3(seed=1),
        peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "down_proj"], lora_dropout=0.0),
    )
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


def test_merged_weights_include_lora_on_the_embedding(make_qwen3) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], lora_dropout=0.0, init_lora_weights=False)
    lora = peft.get_peft_model(make_qwen3(seed=1, tie_word_embeddings=False), config).eval()
    plain = make_qwen3(seed=2, tie_word_embeddings=False)
    plain.load_state_dict(dict(merged_weights(lora)))
    tokens = torch.tensor([[3, 7, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, lora(tokens).logits, atol=1e-5, rtol=1e-5)
        with lora.disable_adapter():
            base_embedding = lora.get_input_embeddings().weight
            assert not torch.allclose(plain.get_input_embeddings().weight, base_embedding, atol=1e-3)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # peft warns about the tied case
@pytest.mark.parametrize(
    ("tied", "kind", "target_modules", "message"),
    [
        (
            True,
            "lora",
            ["q_proj", "embed_tokens"],
            "LoRA on 'model.embed_tokens' changes only one of the tied input embedding",
        ),
        (False, "dora", ["q_proj"], "uses DoraLinearVariant, whose merged weights are not W \\+ B A"),
        (
            False,
            "ia3",
            ["q_proj"],
            "'model.layers.0.self_attn.q_proj' is a peft.tuners.ia3.layer.Linear layer; weight sync merges only LoRA",
        ),
    ],
)
def test_adapters_that_do_not_merge_as_a_plain_delta_raise(make_qwen3, tied, kind, target_modules, message) -> None:
    from thundersync.errors import BackendCapabilityError

    peft = pytest.importorskip("peft")
    if kind == "ia3":
        config = peft.IA3Config(target_modules=target_modules, feedforward_modules=[])
    else:
        config = peft.LoraConfig(r=4, target_modules=target_modules, lora_dropout=0.0, use_dora=kind == "dora")
    model = peft.get_peft_model(make_qwen3(tie_word_embeddings=tied), config)
    with pytest.raises(BackendCapabilityError, match=message):
        dict(merged_weights(model))
