"""Agent apps written against an OpenAI client, trained on exactly what they sampled.

- :mod:`~.app`: :class:`AgentApp` (``async run(episode)``), :class:`AppEpisode` (what an app gets:
  the task, an ``openai.AsyncOpenAI`` client, a ``base_url``), :class:`FunctionApp` (a plain
  ``async def agent(client, task)``);
- :mod:`~.endpoint`: :class:`PolicyEndpoint`, chat completions and completions served by a
  :class:`~thundersync.generation.Generator` through a chat template, every request recorded;
- :mod:`~.episode`: :class:`EpisodeRecorder`, an episode's requests turned into events;
- :mod:`~.serving`: the endpoint as an ASGI app (:class:`EpisodeRoutes`), an in-process
  client (:func:`openai_client`) and a local HTTP server (:class:`LocalServer`);
- :mod:`~.verifiers_env`: a verifiers environment as a task source and an app.

The ``agent-app`` stage (:mod:`thundersync.stages.agent_app`) drives them. This package sits
between the pipeline runtime and the tasks: it uses tasks, generation and tools; the stages use it.
``openai``, ``httpx``, ``uvicorn`` and ``verifiers`` are imported only when used
(``pip install 'thundersync[openai]'``, ``'thundersync[verifiers]'``).
"""

from __future__ import annotations

from thundersync.agents.app import AgentApp, AppEpisode, FunctionApp, load_app_function
from thundersync.agents.endpoint import EndpointSettings, PolicyEndpoint
from thundersync.agents.episode import Emit, EpisodeRecorder, GroupPrompt, Turn
from thundersync.agents.serving import EpisodeRoutes, LocalServer, openai_client
from thundersync.agents.verifiers_env import VerifiersEnvironment

__all__ = [
    "AgentApp",
    "AppEpisode",
    "Emit",
    "EndpointSettings",
    "EpisodeRecorder",
    "EpisodeRoutes",
    "FunctionApp",
    "GroupPrompt",
    "LocalServer",
    "PolicyEndpoint",
    "Turn",
    "VerifiersEnvironment",
    "load_app_function",
    "openai_client",
]
