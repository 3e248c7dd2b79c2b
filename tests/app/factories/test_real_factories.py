"""The real factories: model, tokenizer, objectives, optimizer, schedule, generators (CPU, tiny Qwen3)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel

from thundersync.app.factories import generators, models, training
from thundersync.app.files.build import build_objects
from thundersync.app.files.definition import loads
from thundersync.errors import ConfigError
from thundersync.generation.torch_generator import TorchGenerator
from thundersync.generation.vllm_generator import VLLMGenerator
from thundersync.grpo import RewardLinearBackward
from thundersync.opd import OPDStream
from thundersync.tools.base import ByteTokenizer

SHAPES: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
LORA: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_model_from_config_is_a_seeded_fp32_qwen3_in_eval_mode() -> None:
    model = models.model(config=SHAPES, seed=3)
    assert type(model).__name__ == "Qwen3ForCausalLM" and not model.training
    assert model.config.vocab_size == 300 and model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    again, other = models.model(config=SHAPES, seed=3), models.model(config=SHAPES, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(_state(model).values(), _state(again).values(), strict=True))
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    assert models.model(config=SHAPES, dtype="float64").lm_head.weight.dtype == torch.float64


def test_a_lora_adapter_is_initialised_from_the_seed_whatever_the_global_generator_holds() -> None:
    """Every rank of a launch builds the file's model: the same seed must give the same adapter."""

    def adapter(seed: int) -> dict[str, torch.Tensor]:
        built = models.model(config=SHAPES, lora=LORA, seed=seed)
        return {name: p.detach().clone() for name, p in built.named_parameters() if p.requires_grad}

    first = adapter(0)
    torch.rand(7)  # the global generator moves on between the builds
    second, other = adapter(0), adapter(1)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)


def test_model_with_lora_trains_the_adapter_alone() -> None:
    model = models.model(config=SHAPES, lora=LORA)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert isinstance(model, PeftModel) and not model.training
    assert trainable and all("lora_" in name for name in trainable)
    assert len(training.streaming_run(model=model).params) == len(trainable)


def test_model_errors_name_the_wrong_fields() -> None:
    with pytest.raises(ConfigError, match="^lora: unknown LoraConfig field\\(s\\) rank; valid fields: .*\\br\\b"):
        models.model(config=SHAPES, lora={"rank": 4})
    with pytest.raises(ConfigError, match="^config: unknown Qwen3Config field\\(s\\) hidden; valid fields: "):
        models.model(config={"hidden": 32})
    with pytest.raises(ConfigError, match="^give the model either path .* or config .*, not neither$"):
        models.model()
    with pytest.raises(ConfigError, match="^give the model either path .* or config .*, not both$"):
        models.model(path="x", config=SHAPES)
    with pytest.raises(ConfigError, match="^unknown model architecture 'qwen9'"):
        models.model(config=SHAPES, architecture="qwen9")


def test_model_from_a_local_directory_loads_offline(tmp_path: Path) -> None:
    saved = models.model(config=SHAPES, seed=5)
    saved.save_pretrained(tmp_path / "m")
    loaded = models.model(path=str(tmp_path / "m"))
    assert all(torch.equal(a, b) for a, b in zip(_state(saved).values(), _state(loaded).values(), strict=True))
    with pytest.raises(
        ConfigError, match="^cannot load a model from '.*missing' \\(a local directory; nothing is downloaded\\)"
    ):
        models.model(path=str(tmp_path / "missing"))


def test_tokenizer_builtin_bytes_and_its_errors() -> None:
    tok = models.tokenizer(builtin="bytes")
    assert isinstance(tok, ByteTokenizer) and tok.decode(tok.encode("1+2=3")) == "1+2=3"
    with pytest.raises(ConfigError, match='^give the tokenizer either path .* or builtin = "bytes", not both$'):
        models.tokenizer(path="x", builtin="bytes")


def test_tokenizer_from_a_local_directory_loads_offline(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models as vocabularies
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(vocabularies.WordLevel({"[UNK]": 0, "add": 1, "two": 2}, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="[UNK]").save_pretrained(tmp_path / "t")
    tok = models.tokenizer(path=str(tmp_path / "t"))
    assert tok.encode("add two") == [1, 2] and tok.decode([1, 2]) == "add two"
    with pytest.raises(ConfigError, match="^cannot load a tokenizer from '.*missing' \\(a local directory"):
        models.tokenizer(path=str(tmp_path / "missing"))


def test_objectives_wrap_the_library_configs() -> None:
    run = training.streaming_run(model=models.model(config=SHAPES))
    grpo = training.grpo(run=run, estimator="rloo", eps=0.0, pack_tokens=0)
    assert isinstance(grpo, RewardLinearBackward) and grpo.config.estimator == "rloo" and grpo.config.pack_tokens == 0
    opd = training.opd(run=run, normalization="sum")
    assert isinstance(opd, OPDStream) and opd.config.normalization == "sum"
    for factory in (training.grpo, training.opd):
        with pytest.raises(
            ConfigError, match=r"process_env \{'A': '1'\} is an option of a learner process.*set process = true"
        ):
            factory(run=run, process_env={"A": "1"})
        with pytest.raises(ConfigError, match=r"process_device 'cuda:1' is an option of a learner process"):
            factory(run=run, process_device="cuda:1")


def test_optimizer_by_name_maximizes_grpo_and_minimizes_opd() -> None:
    run = training.streaming_run(model=models.model(config=SHAPES))
    adamw = training.optimizer(objective=training.grpo(run=run), name="AdamW", lr=1e-3, weight_decay=0.0)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["maximize"] is True
    assert adamw.param_groups[0]["params"] == run.params and adamw.defaults["lr"] == 1e-3
    sgd = training.optimizer(objective=training.opd(run=run), name="SGD", lr=0.1)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["maximize"] is False


def test_optimizer_with_sharded_state_in_one_process_is_the_plain_optimizer(caplog: pytest.LogCaptureFixture) -> None:
    run = training.streaming_run(model=models.model(config=SHAPES))
    with caplog.at_level("INFO", logger="thundersync.app.factories.training"):
        adamw = training.optimizer(objective=training.grpo(run=run), name="AdamW", shard_state=True, lr=1e-3)
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["maximize"] is True
    (record,) = [r for r in caplog.records if r.name == "thundersync.app.factories.training"]
    assert record.levelname == "INFO" and "optimizer_not_sharded" in record.getMessage()


def test_optimizer_errors_list_what_is_valid() -> None:
    objective = training.grpo(run=training.streaming_run(model=models.model(config=SHAPES)))
    with pytest.raises(ConfigError, match="^name: unknown torch.optim optimizer 'Adamw'; valid: .*AdamW"):
        training.optimizer(objective=objective, name="Adamw")
    with pytest.raises(
        ConfigError, match="^learning_rate: AdamW takes no option\\(s\\) learning_rate; its options: lr, "
    ):
        training.optimizer(objective=objective, name="AdamW", learning_rate=1e-3)
    with pytest.raises(ConfigError, match="^maximize: maximize = False would train the reward objective the wrong way"):
        training.optimizer(objective=objective, name="AdamW", maximize=False)


@pytest.mark.parametrize(
    ("step", "factor"),
    [(0, 0.5), (1, 1.0), (2, 1.0), (3, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))), (4, 0.55), (6, 0.1), (50, 0.1)],
)
def test_schedule_warms_up_then_decays_to_its_floor(step: int, factor: float) -> None:
    assert training.schedule_factor(step, warmup_steps=2, decay_steps=4, floor_ratio=0.1) == pytest.approx(factor)


def test_lr_schedule_sets_the_optimizer_learning_rate() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    schedule = training.lr_schedule(optimizer=optimizer, warmup_steps=2, decay_steps=4, floor_ratio=0.1)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))])


def test_torch_generator_wraps_the_model_and_validates_its_sizes() -> None:
    model = models.model(config=SHAPES)
    assert isinstance(generators.torch_generator(model=model, max_batch=4, max_seq_len=32), TorchGenerator)
    with pytest.raises(ConfigError, match=r"^invalid TorchGenerator option: Expected `int` >= 2 - at `\$.max_seq_len`"):
        generators.torch_generator(model=model, max_seq_len=1)


def test_openai_generator_validates_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="^base_url 'localhost:8000' is not an http\\(s\\) URL"):
        generators.openai_generator(base_url="localhost:8000", model="m")
    monkeypatch.delenv("TS_TEST_KEY", raising=False)
    with pytest.raises(
        ConfigError, match="^api_key_env names 'TS_TEST_KEY', but that environment variable is not set$"
    ):
        generators.openai_generator(base_url="http://localhost:8000", model="m", api_key_env="TS_TEST_KEY")
    monkeypatch.setenv("TS_TEST_KEY", "sk-test")
    made = generators.openai_generator(base_url="http://localhost:8000", model="m", api_key_env="TS_TEST_KEY")
    assert made.model == "m"


def test_sandbox_tools_take_a_tokenizer_reference() -> None:
    spec = loads(
        '[objects.tok]\nfactory = "tokenizer"\nbuiltin = "bytes"\n[objects.tools]\nfactory = "sandbox-tools"\n'
        'backend = "local"\ntools = ["calculator"]\ntokenizer = { object = "tok" }\n[objects.parser]\nfactory = "qwen3-tool-calls"\n'
        'tokenizer = { object = "tok" }\n[stages.source]\ntype = "source"\nprompts = [[1]]\n'
    )
    built = build_objects(spec)
    assert built["tools"].tokenizer is built["tok"] and built["parser"].tokenizer is built["tok"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")
def test_vllm_generator_from_a_file_passes_engine_fields_to_vllm(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    models.model(config={**SHAPES, "max_position_embeddings": 256}).save_pretrained(tmp_path / "m")
    spec = loads(
        f'[objects.generator]\nfactory = "vllm-generator"\nmodel = "{tmp_path / "m"}"\ndtype = "float32"\n'
        "max_model_len = 128\nkv_cache_memory_bytes = 67108864\nskip_tokenizer_init = true\n"
        '[stages.source]\ntype = "source"\nprompts = [[1]]\n'
    )
    generator = build_objects(spec)["generator"]
    try:
        assert isinstance(generator, VLLMGenerator)
        assert generator.llm.llm_engine.model_config.max_model_len == 128  # an engine field, passed on
    finally:
        generator.close()
    assert not torch.distributed.is_initialized()  # the engine's process group went with it
