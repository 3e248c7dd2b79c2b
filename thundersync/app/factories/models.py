"""The ``model`` and ``tokenizer`` factories of pipeline files: what a run trains and how it reads text.

::

    [objects.model]
    factory = "model"
    config = { vocab_size = 300, hidden_size = 32, num_hidden_layers = 2, num_attention_heads = 4,
               num_key_value_heads = 2, head_dim = 8, intermediate_size = 64 }
    seed = 0                           # the initial weights of a model built from its config, and of a LoRA adapter
    dtype = "float32"                  # "bfloat16", "float64"
    device = "cpu"                     # "cuda", "cuda:1", "auto" (cuda when there is one); absent: run.device
    lora = { r = 8, lora_alpha = 16, target_modules = ["q_proj", "v_proj"] }

    [objects.tokenizer]
    factory = "tokenizer"
    builtin = "bytes"                  # or "qwen3-chat" / "llama3-chat" (byte-level, a chat template),
                                       # or: path = "models/qwen3" (a local transformers tokenizer)

Nothing is downloaded: ``path`` is read with ``local_files_only=True``. transformers and peft are
imported when a factory is called, never by ``thundersync check``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn

from thundersync._device import resolve_device
from thundersync.app.checkpoints.run_directory import model_directory
from thundersync.errors import ConfigError
from thundersync.tasks import model_teacher
from thundersync.tools import chat_tokenizer
from thundersync.tools.base import ByteTokenizer, Tokenizer

__all__ = ["model", "tokenizer", "transformers_teacher"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def model(
    *,
    path: str | None = None,
    config: dict[str, Any] | None = None,
    architecture: str = "qwen3",
    seed: int = 0,
    dtype: Literal["float32", "bfloat16", "float64"] = "float32",
    device: str = "cpu",
    lora: dict[str, Any] | None = None,
) -> nn.Module:
    """A transformers causal LM in eval mode (the streaming engine refuses dropout).

    Exactly one of ``path`` (a local directory, loaded with ``from_pretrained`` offline) and
    ``config`` (the fields of the ``architecture``'s transformers config, e.g. ``Qwen3Config``;
    its weights are initialised from ``seed``). ``lora``: the fields of peft's ``LoraConfig``;
    the model is then a peft model whose adapter alone is trainable, initialised from ``seed`` too
    (so every process that builds the file's model, each rank of a launch, builds the same adapter). ``device``: ``cpu``, ``cuda``,
    ``cuda:N`` or ``auto`` (a file's ``[run] device`` when its table gives none). ``float64`` casts the
    weights; transformers' own RMSNorm still computes in float32, so the exactness tests use their
    own norms (``tests/engine/tiny_models.py``) rather than this factory.
    """
    if (path is None) == (config is None):
        raise ConfigError(
            "give the model either path (a local model directory) or config (its shapes), not "
            f"{'both' if path is not None else 'neither'}"
        )
    target = resolve_device(device)
    if path is not None:
        built = _from_directory(path, DTYPES[dtype])
    else:
        assert config is not None
        built = _from_config(architecture, config, seed)
    built = built.to(device=target, dtype=DTYPES[dtype])
    if lora is not None:
        built = _with_lora(built, lora, seed, target)
    return built.eval()


def _from_directory(path: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        loaded: nn.Module = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except OSError as error:
        raise ConfigError(
            f"cannot load a model from {path!r} (a local directory; nothing is downloaded): {error}"
        ) from None
    return loaded


def _from_config(architecture: str, fields: dict[str, Any], seed: int) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config_class = type(AutoConfig.for_model(architecture))
    except ValueError:
        raise ConfigError(
            f"unknown model architecture {architecture!r}; give a transformers model_type, e.g. 'qwen3'"
        ) from None
    params = inspect.signature(config_class.__init__).parameters
    valid = [name for name in params if name not in ("self", "kwargs")] + ["attn_implementation"]
    unknown = sorted(set(fields) - set(valid))
    if unknown:
        raise ConfigError(
            f"config: unknown {config_class.__name__} field(s) {', '.join(unknown)}; valid fields: {', '.join(valid)}"
        )
    config = config_class(**{"attn_implementation": "sdpa", **fields})  # eager softmax is fp32 even in fp64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        built: nn.Module = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    return built


def _with_lora(base: nn.Module, fields: dict[str, Any], seed: int, device: torch.device) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    valid = [field.name for field in dataclasses.fields(LoraConfig) if field.init]
    unknown = sorted(set(fields) - set(valid))
    if unknown:
        raise ConfigError(f"lora: unknown LoraConfig field(s) {', '.join(unknown)}; valid fields: {', '.join(valid)}")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # the adapter's random init (peft draws lora_A from the global generator)
        wrapped: nn.Module = get_peft_model(base, LoraConfig(**fields))
    return wrapped


def tokenizer(
    *, path: str | None = None, builtin: Literal["bytes", "qwen3-chat", "llama3-chat"] | None = None
) -> Tokenizer:
    """A tokenizer: a transformers tokenizer from the local directory ``path`` (offline), or
    ``builtin = "bytes"``: :class:`~thundersync.tools.base.ByteTokenizer`, made in code, whose
    ids 0-255 are the bytes of UTF-8 text. A model used with it needs ``vocab_size >= 256``
    (ids above 255 decode to nothing, so a larger vocabulary is fine: e.g. 300).
    ``"qwen3-chat"`` / ``"llama3-chat"``: the same 256 bytes as a transformers tokenizer with
    the style's special tokens and chat template (:func:`~thundersync.tools.chat_tokenizer`; ids
    256 and up are the special tokens, so ``vocab_size >= 264`` covers both)."""
    if (path is None) == (builtin is None):
        raise ConfigError(
            'give the tokenizer either path (a local tokenizer directory) or builtin = "bytes", not '
            f"{'both' if path is not None else 'neither'}"
        )
    if builtin == "bytes":
        return ByteTokenizer()
    if builtin is not None:
        return cast(Tokenizer, chat_tokenizer("qwen3" if builtin == "qwen3-chat" else "llama3"))
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except OSError as error:
        raise ConfigError(
            f"cannot load a tokenizer from {path!r} (a local directory; nothing is downloaded): {error}"
        ) from None
    return cast(Tokenizer, loaded)  # encode/decode fit the protocol; transformers' stubs spell them wider


@functools.wraps(model_teacher.transformers_teacher)  # the same fields in a pipeline file
def transformers_teacher(*, path: str, **options: Any) -> model_teacher.TransformersTeacher:
    """``transformers-teacher``: :func:`thundersync.tasks.model_teacher.transformers_teacher`, whose
    ``path`` may also be a training run's checkpoint directory (``runs/agent_grpo``): the teacher is
    then the newest checkpoint of full weights of the run that owns it (its ``run.json``), whatever
    step that is (:func:`~thundersync.app.checkpoints.run_directory.model_directory`)."""
    return model_teacher.transformers_teacher(path=str(model_directory(Path(path))), **options)
