"""How another process rebuilds a model around tensors it was given: the structure from the
model's class and config (a peft model: its base, then its adapters), on the meta device, each
parameter and buffer then replaced by the tensor of its name. :mod:`thundersync.engine.process`
uses it for its child, over the parent's shared tensors or over copies on a device of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from thundersync.errors import ConfigError

__all__ = ["named_tensors", "rebuild_recipe", "share_into"]


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def rebuild_recipe(model: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    """How another process builds ``model``'s structure (not its values): a picklable callable.

    A transformers model: ``type(model)(model.config)``. A peft model: its base the same way,
    wrapped by ``get_peft_model`` with each of its adapters' configs, the active one set."""
    from thundersync.model.anatomy import unwrap_peft

    base = unwrap_peft(model)
    config = getattr(base, "config", None)
    if config is None:
        raise ConfigError(
            f"a learner process rebuilds the model from type(model)(model.config); {type(base).__name__} has "
            "no config: pass a transformers causal LM, or one wrapped by peft"
        )
    if base is model:
        return functools.partial(_transformers_model, type(model), config)
    adapters = getattr(model, "peft_config", None)
    if not isinstance(adapters, dict) or not adapters:
        raise ConfigError(f"{type(model).__name__} wraps a model but has no peft_config to rebuild it from")
    active = getattr(model, "active_adapter", next(iter(adapters)))
    return functools.partial(_peft_model, type(base), config, dict(adapters), active)


def _transformers_model(model_class: type, config: Any) -> torch.nn.Module:
    built: torch.nn.Module = model_class(config)
    return built


def _peft_model(base_class: type, config: Any, adapters: dict[str, Any], active: str) -> torch.nn.Module:
    from peft import get_peft_model

    (first, first_config), *others = adapters.items()
    model = get_peft_model(base_class(config), first_config, adapter_name=first)
    for name, adapter_config in others:
        model.add_adapter(name, adapter_config)
    model.set_adapter(active)
    built: torch.nn.Module = model
    return built


def share_into(
    build: Callable[[], torch.nn.Module], tensors: dict[str, torch.Tensor], frozen: frozenset[str] = frozenset()
) -> torch.nn.Module:
    """``build()`` on the meta device, each parameter and buffer replaced by the tensor of its name
    (``named_parameters()``/``named_buffers()`` names), tied ones kept tied; parameters named in
    ``frozen`` do not require gradients."""
    with torch.device("meta"):
        model = build()
    adopted: dict[int, torch.Tensor] = {}  # id of a meta tensor -> the tensor in its place
    for prefix, module in model.named_modules():
        for slots in (module._parameters, module._buffers):
            for attr, meta in list(slots.items()):
                if meta is None:
                    continue
                if id(meta) not in adopted:  # the first name of a tied tensor is the one sent
                    name = f"{prefix}.{attr}" if prefix else attr
                    shared = tensors[name]
                    is_parameter = isinstance(meta, torch.nn.Parameter)
                    adopted[id(meta)] = torch.nn.Parameter(shared, name not in frozen) if is_parameter else shared
                slots[attr] = adopted[id(meta)]
    left = [name for name, t in named_tensors(model) if t.is_meta]
    assert not left, f"tensors the parent did not send: {left}"
    return model.eval()
