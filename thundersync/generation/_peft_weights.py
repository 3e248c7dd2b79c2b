"""Export a (possibly peft-wrapped) policy's weights under transformers checkpoint names.

A peft LoRA model is exported merged: every LoRA-wrapped layer (Linear, Embedding, Conv) yields
``W + sum_a scale_a B_a A_a`` under its plain name (``...q_proj.weight``), so an inference engine
that knows nothing about the adapter serves exactly the policy. Tied weights are yielded once.
Adapters whose merged model is not ``W + delta`` (DoRA and other LoRA variants, ``lora_bias``,
non-LoRA peft methods, LoRA on an embedding tied to the output head) raise
:class:`~thundersync.errors.BackendCapabilityError` instead of exporting a different model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

from thundersync.errors import BackendCapabilityError
from thundersync.model.anatomy import unwrap_peft

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["is_peft_model", "merged_weights"]


def is_peft_model(model: nn.Module) -> TypeGuard[PeftModel]:
    """Whether ``model`` is a peft ``PeftModel`` (told by its ``get_base_model``; peft need not be imported)."""
    return callable(getattr(model, "get_base_model", None))


def _active_lora(path: str, module: nn.Module) -> list[str]:
    """The adapters whose delta ``module`` adds to its base weight; raises for what is not a plain delta."""
    if not hasattr(module, "lora_A"):
        raise BackendCapabilityError(
            f"{path!r} is a {type(module).__module__}.{type(module).__name__} layer; weight sync merges only LoRA adapters: "
            "train with LoRA or sync the adapter another way"
        )
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return []  # already inside the base weight, or not applied
    adapters = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]  # type: ignore[union-attr, operator]
    for adapter in adapters:
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if variant is not None or getattr(module, "lora_bias", {}).get(adapter, False):
            kind = type(variant).__name__ if variant is not None else "lora_bias"
            raise BackendCapabilityError(
                f"adapter {adapter!r} on {path!r} uses {kind}, whose merged weights are not W + B A; "
                "weight sync supports plain LoRA only: train without it"
            )
    return adapters


def _base_weight(module: nn.Module | None) -> object:
    get_base = getattr(module, "get_base_layer", None)
    return getattr(get_base() if callable(get_base) else module, "weight", None)


def _check_adapters(base: nn.Module) -> dict[str, list[str]]:
    """Adapter names per LoRA layer path, after checking every peft layer can be merged."""
    layers = {path: _active_lora(path, m) for path, m in base.named_modules() if hasattr(m, "base_layer")}
    ends = [getattr(base, f"get_{end}_embeddings", lambda: None)() for end in ("input", "output")]
    if ends[0] is not None and _base_weight(ends[0]) is _base_weight(ends[1]):
        for path, adapters in layers.items():
            if adapters and any(base.get_submodule(path) is end for end in ends):
                raise BackendCapabilityError(
                    f"LoRA on {path!r} changes only one of the tied input embedding and output head, "
                    "which a tied checkpoint cannot express: untie the embeddings or do not target it"
                )
    return layers


def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` of every parameter, LoRA deltas merged in (detached)."""
    base = unwrap_peft(model)
    layers = _check_adapters(base)
    with torch.no_grad():
        for name, param in base.named_parameters():
            if "lora_" in name:
                continue
            if "modules_to_save" in name or "original_module" in name:
                raise BackendCapabilityError(
                    f"parameter {name!r} belongs to a peft modules_to_save wrapper, which weight sync "
                    "does not support; train those modules without modules_to_save"
                )
            if ".base_layer." not in name:
                yield name, param.detach()
                continue
            path, _, leaf = name.partition(".base_layer.")
            tensor = param.detach()
            if leaf == "weight":
                module = base.get_submodule(path)
                tensor = tensor + sum((module.get_delta_weight(a) for a in layers[path]), 0)  # type: ignore[operator]
            yield f"{path}.{leaf}", tensor
