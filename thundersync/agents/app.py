"""What an agent app is: code that runs one episode against an OpenAI client and may return its reward.

An :class:`AgentApp` is any object with ``async run(episode) -> float | None``; the ``agent-app``
stage (:mod:`thundersync.stages.agent_app`) calls it once per trajectory with an
:class:`AppEpisode`: the task's fields, an ``openai.AsyncOpenAI`` client whose every request is
served by the policy and recorded (:meth:`AppEpisode.client`), and the same endpoint's
``base_url`` for a program in another process. An app written plainly against the OpenAI client
needs nothing else: :class:`FunctionApp` (the ``function-app`` factory) runs
``async def agent(client, task) -> float`` from a module or a file, unchanged::

    async def agent(client: AsyncOpenAI, task: dict) -> float:
        messages = [{"role": "user", "content": task["prompt"]}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        ...
        return 1.0 if answer == task["answer"] else 0.0
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from thundersync.errors import ConfigError
from thundersync.events import Id

__all__ = ["AgentApp", "AppEpisode", "FunctionApp", "load_app_function"]


class AppEpisode:
    """One episode as an app sees it: ``task`` (the task's fields: ``prompt`` or ``messages``,
    ``answer``...), ``prompt_ids`` (the source's rendering of the prompt), ``group_id`` and
    ``trajectory_id``, ``model`` (the name to send), ``base_url`` (the endpoint of this episode:
    in process unless the stage serves HTTP) and :meth:`client`."""

    def __init__(
        self,
        *,
        task: Mapping[str, Any],
        prompt_ids: list[int],
        group_id: Id,
        trajectory_id: Id,
        model: str,
        base_url: str,
        client: Callable[[], Any],
    ) -> None:
        self.task, self.prompt_ids = dict(task), prompt_ids
        self.group_id, self.trajectory_id, self.model, self.base_url = group_id, trajectory_id, model, base_url
        self._make_client = client
        self._client: Any = None

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        """The task's chat (its ``messages``, or its ``prompt`` as one user message; None: neither)."""
        if isinstance(self.task.get("messages"), list):
            return [dict(message) for message in self.task["messages"]]
        if isinstance(self.task.get("prompt"), str):
            return [{"role": "user", "content": self.task["prompt"]}]
        return None

    def client(self) -> Any:
        """The episode's ``openai.AsyncOpenAI`` (made on first use; the stage closes it)."""
        if self._client is None:
            self._client = self._make_client()
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()


@runtime_checkable
class AgentApp(Protocol):
    """Runs one episode; returns its reward, or None when a reward stage scores it."""

    async def run(self, episode: AppEpisode) -> float | None:
        """Play ``episode`` through ``episode.client()`` (or ``episode.base_url``)."""
        ...


def load_app_function(path: str) -> Callable[..., Awaitable[Any]]:
    """The async function at ``"package.module:function"`` or ``"path/to/file.py:function"``."""
    where, colon, name = path.rpartition(":")
    if not colon or not where or not name:
        raise ConfigError(f"an agent app is given as 'module:function' or 'file.py:function', got {path!r}")
    try:
        if where.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            if spec is None or spec.loader is None:
                raise ImportError(f"no Python file at {where}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (ImportError, OSError) as error:
        raise ConfigError(f"cannot load the agent app {path!r}: {error}; check the path or the module name") from None
    target = getattr(module, name, None)
    if not inspect.iscoroutinefunction(target):
        raise ConfigError(
            f"the agent app {path!r} must be an async function agent(client, task), got {type(target).__name__}"
        )
    return target


class FunctionApp:
    """The ``function-app`` factory: ``await function(client, task)`` per episode, its return the
    reward (a number, or None when a reward stage scores the trajectory)."""

    def __init__(self, *, function: str) -> None:
        self.name = function
        self.function = load_app_function(function)

    async def run(self, episode: AppEpisode) -> float | None:
        result = await self.function(episode.client(), dict(episode.task))
        if result is None:
            return None
        if isinstance(result, bool) or not isinstance(result, int | float):
            raise ConfigError(f"the agent app {self.name!r} returned {result!r}; return the reward (a number) or None")
        return float(result)
