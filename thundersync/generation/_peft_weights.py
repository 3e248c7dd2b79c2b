"""Export a (possibly peft-wrapped) policy's weights under transformers checkpoint names.

A peft LoRA model is exported merged: every LoRA-wrapped Linear yields ``W + sum_a scale_a B_a A_a``
under its plain name (``...q_proj.weight``), so an inference engine that knows nothing about the
adapter serves exactly the policy. Tied weights are yielded once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from thundersync.engine.anatomy import unwrap_peft
from thundersync.errors import BackendCapabilityError

__all__ = ["is_peft_model", "merged_weights"]


def is_peft_model(model: nn.Module) -> bool:
    return callable(getattr(model, "get_base_model", None))


def _delta(module: nn.Module) -> torch.Tensor | int:
    if getattr(module, "merged", False):
        return 0  # the adapter is already inside the base weight
    adapters = [a for a in module.active_adapters if a in module.lora_A]  # type: ignore[union-attr, operator]
    return sum((module.get_delta_weight(a) for a in adapters), 0)  # type: ignore[operator]


def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` of every parameter, LoRA deltas merged in (detached)."""
    base = unwrap_peft(model)
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
                tensor = tensor + _delta(base.get_submodule(path))
            yield f"{path}.{leaf}", tensor
