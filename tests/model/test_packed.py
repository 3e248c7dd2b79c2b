"""The adapter's log-probs equal the model's own forward on full sequences."""

from __future__ import annotations

import pytest
import torch

from tests.engine.tiny_models import tiny_qwen3, with_lora
from thundersync.errors import ConfigError
from thundersync.model.anatomy import decoder_anatomy
from thundersync.model.packed import ChunkSpec, empty_prefix, forward_pack, head_logprobs


def _model_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[None]).logits[0].double()
    return logits.log_softmax(-1)[:-1].gather(-1, tokens[1:, None])[:, 0]


def _adapter_logprobs_split(model: torch.nn.Module, tokens: torch.Tensor, cut: int) -> torch.Tensor:
    """Log-probs via two chunks: tokens[:cut] (from scratch), then tokens[cut-1:] after its K/V.

    The second chunk starts with the first chunk's last token (the boundary token), reading the
    first chunk's K/V for positions < cut - 1 only; both chunks then go in ONE pack to check that
    packing keeps chunks apart.
    """
    anatomy = decoder_anatomy(model)
    first = forward_pack(anatomy, [ChunkSpec(tokens[:cut], 0, empty_prefix(anatomy))])
    prefix = [(k[:, : cut - 1].detach(), v[:, : cut - 1].detach()) for k, v in first.kv(0)]
    pack = forward_pack(
        anatomy,
        [
            ChunkSpec(tokens[:cut], 0, empty_prefix(anatomy)),
            ChunkSpec(tokens[cut - 1 :], cut - 1, prefix),
        ],
    )
    first_rows, second_rows = (pack.hidden[pack.offsets[c] : pack.offsets[c + 1]] for c in (0, 1))
    lp_first = head_logprobs(anatomy, first_rows[:-1], tokens[1:cut])
    lp_second = head_logprobs(anatomy, second_rows[:-1], tokens[cut:])
    return torch.cat([lp_first, lp_second]).double()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_adapter_logprobs_equal_the_models_own_forward(lora: bool, tie: bool) -> None:
    model = tiny_qwen3(tie=tie)
    if lora:
        model = with_lora(model)
    tokens = torch.randint(0, 97, (37,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = _model_logprobs(model, tokens)
        for cut in (1, 2, 17, 36):
            got = _adapter_logprobs_split(model, tokens, cut)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_adapter_gradients_reach_parameters_and_prefix() -> None:
    model = tiny_qwen3()
    anatomy = decoder_anatomy(model)
    tokens = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        first = forward_pack(anatomy, [ChunkSpec(tokens[:6], 0, empty_prefix(anatomy))])
    proxy = [(k[:, :5].clone().requires_grad_(), v[:, :5].clone().requires_grad_()) for k, v in first.kv(0)]
    pack = forward_pack(anatomy, [ChunkSpec(tokens[5:], 5, proxy)])
    head_logprobs(anatomy, pack.hidden[:-1], tokens[6:]).sum().backward()
    assert all(k.grad is not None and k.grad.abs().sum() > 0 for k, _ in proxy)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_anatomy_rejects_a_model_without_the_transformers_layout() -> None:
    with pytest.raises(ConfigError, match="cannot find the decoder of Linear"):
        decoder_anatomy(torch.nn.Linear(2, 2))


def _tiny_family(family: str) -> torch.nn.Module:
    """Tiny random Qwen2 (q/k/v biases, no q/k norms) and Llama models, built in code."""
    import transformers

    common = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, head_dim=8))
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_adapter_logprobs_equal_the_models_own_forward_for_qwen2_and_llama(family: str) -> None:
    model = _tiny_family(family)
    tokens = torch.randint(0, 97, (29,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = _model_logprobs(model, tokens)
        for cut in (1, 13, 28):
            torch.testing.assert_close(_adapter_logprobs_split(model, tokens, cut), expected, rtol=1e-5, atol=1e-6)


def test_anatomy_rejects_a_layer_part_that_is_not_a_module() -> None:
    model = tiny_qwen3()
    layer = model.model.layers[1]
    del layer.mlp
    layer.mlp = torch.zeros(3)  # a plain attribute now, not a submodule
    with pytest.raises(ConfigError, match=r"Qwen3DecoderLayer\.mlp is a Tensor, not a torch module"):
        decoder_anatomy(model)


def test_input_embedding_weight_names_a_model_without_one() -> None:
    from thundersync.model.anatomy import input_embedding_weight

    assert input_embedding_weight(tiny_qwen3()).shape == (97, 32)
    with pytest.raises(ConfigError, match=r"Linear has no input embedding matrix \(get_input_embeddings\(\)\.weight\)"):
        input_embedding_weight(torch.nn.Linear(2, 2))
