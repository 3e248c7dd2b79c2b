"""Publishing the trained policy to a vLLM OpenAI server (:meth:`OpenAIGenerator.publish`).

A server does not share the learner's weights, so before the run's first batch and after each
optimizer step the trainer hands it the policy through a route the server offers, chosen by ``OpenAIGenerator(publish=...)``:

- ``"lora"``: the policy is a peft LoRA model and the server runs with ``--enable-lora`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. The adapter alone is saved (safetensors) to
  ``DIR/v{version}``, loaded with ``POST /v1/load_lora_adapter`` under the name
  ``{model}-policy-v{version}``, and the requests that follow name that adapter as their model.
  The previous version is then unloaded (``POST /v1/unload_lora_adapter``) and its folder removed.
- ``"reload"``: the server runs with ``VLLM_SERVER_DEV_MODE=1``. Every weight (LoRA merged in) is
  saved to ``DIR/v{version}/model.safetensors`` and loaded in place by
  ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}``; then
  ``POST /reset_prefix_cache`` drops the cache computed with the old weights. The previous
  version's folder is removed.
- a hook, any callable ``hook(model, version, generator)`` (sync or async), for servers with
  neither route (a file names it ``publish = "module:function"``).

``DIR`` must be readable by the server under the same path (a shared file system, or the server on
this machine); it defaults to a private temporary folder, removed when the generator closes.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio.to_thread

from thundersync.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["PublishHook", "PublishRoute", "Publisher", "ServerCalls"]

PublishRoute = Literal["lora", "reload"]
PublishHook = Callable[..., Awaitable[None] | None]
"""``hook(model, version, generator)``: makes the server serve ``model``'s weights as ``version``."""


class ServerCalls(Protocol):
    """What a publisher needs of its generator: JSON posts to the server, and the served name."""

    model: str

    async def post(self, path: str, payload: dict[str, Any]) -> Any: ...


class Publisher:
    """Publishes policy versions to one server by ``route`` (module docstring), files under ``directory``."""

    def __init__(self, route: PublishRoute | PublishHook, directory: str | Path | None = None) -> None:
        if isinstance(route, str) and route not in ("lora", "reload"):
            raise ConfigError(
                f"publish is {route!r}; give 'lora', 'reload', or a hook called as hook(model, version, generator)"
            )
        self.route = route
        self._owned: tempfile.TemporaryDirectory[str] | None = None
        if directory is None:
            self._owned = tempfile.TemporaryDirectory(prefix="thundersync-publish-")
            directory = self._owned.name
        self.directory = Path(directory)
        self._previous: tuple[Path, str] | None = None  # the last published folder and adapter name
        self._base: str | None = None  # the server's own model name, before any adapter

    async def publish(self, generator: ServerCalls, model: nn.Module, version: int) -> None:
        """Make the server behind ``generator`` serve ``model``'s current weights as ``version``."""
        if not isinstance(self.route, str):
            result = self.route(model, version, generator)
            if inspect.isawaitable(result):
                await result
            return
        self._base = self._base or generator.model
        target = self.directory / f"v{version}"
        if self.route == "lora":
            await anyio.to_thread.run_sync(_save_adapter, model, target)
            name = f"{self._base}-policy-v{version}"
            await generator.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(target)})
            generator.model = name
            if self._previous is not None:
                await generator.post("/v1/unload_lora_adapter", {"lora_name": self._previous[1]})
        else:
            await anyio.to_thread.run_sync(_save_weights, model, target)
            await generator.post(
                "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(target)}}
            )
            await generator.post("/reset_prefix_cache", {})
            name = generator.model
        if self._previous is not None:
            shutil.rmtree(self._previous[0], ignore_errors=True)
        self._previous = (target, name)

    def close(self) -> None:
        """Remove the private folder (nothing when the caller gave the directory)."""
        if self._owned is not None:
            self._owned.cleanup()


def _save_adapter(model: nn.Module, target: Path) -> None:
    from thundersync.generation._peft_weights import is_peft_model

    if not is_peft_model(model):
        raise ConfigError(
            f"publish = 'lora' sends a LoRA adapter, but the policy is a {type(model).__name__} without one; "
            "give the model a lora table, or publish with 'reload' (every weight)"
        )
    model.save_pretrained(str(target), safe_serialization=True)  # peft saves the adapter alone


def _save_weights(model: nn.Module, target: Path) -> None:
    from safetensors.torch import save_file

    from thundersync.generation._peft_weights import merged_weights
    from thundersync.generation.vllm_generator import _with_tied_head

    weights = {
        name: tensor.detach().to("cpu", copy=True).contiguous()
        for name, tensor in _with_tied_head(model, merged_weights(model))
    }
    target.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(target / "model.safetensors"))
