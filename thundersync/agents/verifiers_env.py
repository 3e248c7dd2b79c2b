"""A verifiers environment (``verifiers.v1``, the library prime-rl trains) as tasks and an agent app.

::

    [objects.env]
    factory = "verifiers-environment"
    taskset = "my_taskset"              # the taskset's id (an installed or importable package)
    config = { agent = { max_turns = 4 } }  # the rest of verifiers' [env] table, as its CLI takes it
    import_path = "examples"            # a folder put on sys.path first (tasksets next to the file)

    [stages.source]                     # the environment's tasks are the source's
    type = "source"
    objects = { tasks = "env" }

    [stages.app]                        # its rollouts run through the agent-app stage
    type = "agent-app"
    reads = ["source"]
    objects = { app = "env" }

verifiers 0.4 composes an environment from a taskset (tasks, their ``@vf.reward`` functions and
judges: its rubric), a harness (the program that talks to the model: a single request, a
multi-turn loop, a tool loop) and a runtime. :class:`VerifiersEnvironment` builds it with
``vf.load_environment(vf.resolve_env_config(config))``, lists the taskset's tasks as
:class:`~thundersync.tasks.Task` (their ``prompt`` or ``messages`` in the fields, rendered with
``chat`` when given) and, as an :class:`~thundersync.agents.AgentApp`, plays each episode with
``env.run_episode(task, ModelContext(...))`` whose client is the episode's local HTTP endpoint
(``needs_http``: verifiers reaches the model through its interception server, over HTTP), so every
model call of the harness is served by the policy and recorded. The episode's reward is its trace's
(the weighted sum of the task's rewards). An episode whose trace records an error (a harness that
crashed on the model's output) gets reward 0, with a warning: model text never fails the run.

Unless the config says otherwise the agent runs in verifiers' ``subprocess`` runtime (its default
is a remote sandbox) and the interception is one local ``server``. Enter the object
(``async with env:``; ``thundersync run`` and the agent-app stage do) to hold verifiers' serving
resources for the run. ``pip install 'thundersync[verifiers]'``.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from typing import Any

from thundersync._logging import get_logger
from thundersync.agents.app import AppEpisode
from thundersync.errors import AgentAppError, ConfigError, MissingExtraError
from thundersync.sandboxes.output import Tokenizer
from thundersync.tasks.data import Task, record_task
from thundersync.tools.base import ByteTokenizer
from thundersync.tools.chat_template import ChatTemplate

__all__ = ["TASK_INDEX", "VerifiersEnvironment"]

_log = get_logger(__name__)

TASK_INDEX = "verifiers_task"
"""The task field that holds the verifiers task's position in the taskset."""


def _verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise MissingExtraError("a verifiers environment", "verifiers", "verifiers") from error
    return vf


class VerifiersEnvironment:
    """A verifiers environment: its tasks (a :class:`~thundersync.tasks.TaskSource`) and its
    rollouts (an :class:`~thundersync.agents.AgentApp`); see the module docstring.

    ``taskset`` / ``env``: the taskset's and (optionally) the environment's ids, merged into
    ``config`` (verifiers' env config table); ``import_path``: a folder put first on ``sys.path``
    before loading; ``limit``: the first N tasks only (required for an infinite taskset);
    ``tokenizer`` / ``chat``: how task prompts become the source's token ids.
    """

    needs_http = True

    def __init__(
        self,
        *,
        taskset: str = "",
        env: str = "",
        config: dict[str, Any] | None = None,
        import_path: str | None = None,
        limit: int | None = None,
        tokenizer: Tokenizer | None = None,
        chat: ChatTemplate | None = None,
    ) -> None:
        vf = _verifiers()
        if import_path is not None and import_path not in sys.path:
            sys.path.insert(0, import_path)
        self.config = _env_config(taskset, env, config or {})
        try:
            self.env = vf.load_environment(vf.resolve_env_config(self.config))
        except Exception as error:
            raise ConfigError(
                f"cannot load the verifiers environment {self.config.get('taskset')}: {type(error).__name__}: {error}"
            ) from None
        if not self.env.taskset.bounded and limit is None:
            raise ConfigError("the verifiers taskset is infinite; give limit = N (the first N tasks)")
        self._vf_tasks = [task for index, task in enumerate(self.env.taskset) if limit is None or index < limit]
        if not self._vf_tasks:
            raise ConfigError("the verifiers taskset has no tasks")
        text = tokenizer if tokenizer is not None else ByteTokenizer()
        self._tasks = [self._task(index, task, text, chat) for index, task in enumerate(self._vf_tasks)]
        self._serving: Any = None
        self._entered = 0

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    @staticmethod
    def _task(index: int, task: Any, tokenizer: Tokenizer, chat: ChatTemplate | None) -> Task:
        """Our task for verifiers' ``task``: its chat (system prompt first) with a template, else its text."""
        data = task.data
        messages = [] if data.system_prompt is None else [{"role": "system", "content": data.system_prompt}]
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        elif data.prompt:
            messages += [message.model_dump(mode="json", exclude_none=True) for message in data.prompt]
        record: dict[str, Any] = {TASK_INDEX: index}
        if chat is not None and messages:
            record["messages"] = messages
        else:
            record["prompt"] = data.prompt_text or data.name or f"verifiers task {index}"
        return record_task(record, f"verifiers task {index}", tokenizer=tokenizer, chat=chat)

    async def __aenter__(self) -> VerifiersEnvironment:
        """Hold verifiers' serving resources (its interception), or join the context that holds them."""
        if self._entered == 0:
            self._serving = self.env.serving()
            await self._serving.__aenter__()
        self._entered += 1
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._entered -= 1
        if self._entered == 0 and self._serving is not None:
            serving, self._serving = self._serving, None
            await serving.__aexit__(*exc_info)

    async def run(self, episode: AppEpisode) -> float | None:
        """Play one episode of the task ``episode.task`` names through the episode's endpoint."""
        if self._entered == 0:
            raise AgentAppError(
                "the verifiers environment is not open: use 'async with env' (the agent-app stage does)"
            )
        vf = _verifiers()
        task = self._vf_tasks[int(episode.task[TASK_INDEX])]
        client = vf.EvalClientConfig(base_url=episode.base_url, api_key_var="THUNDERSYNC_VERIFIERS_KEY")
        played = await self.env.run_episode(task, vf.ModelContext(model=episode.model, client=client))
        if len(played.traces) != 1:
            raise AgentAppError(
                f"the verifiers episode of trajectory {episode.trajectory_id!r} has {len(played.traces)} traces; "
                "one agent per episode is trained (a single-agent environment)"
            )
        trace = played.traces[0]
        errors = [*played.errors, *trace.errors]
        if errors:
            _log.warning(
                "verifiers_episode_error",
                group=episode.group_id,
                trajectory=episode.trajectory_id,
                error=f"{errors[0].type}: {errors[0].message}"[:500],
            )
            return 0.0
        return float(trace.reward)


def _env_config(taskset: str, env: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """verifiers' env config table with the ids filled in and local defaults for runtime and interception."""
    out = copy.deepcopy(dict(config))
    if taskset:
        out["taskset"] = {**dict(out.get("taskset") or {}), "id": taskset}
    if env:
        out["id"] = env
    if not (out.get("taskset") or {}).get("id"):
        raise ConfigError("a verifiers environment needs a taskset id: taskset = 'ID' (or config.taskset.id)")
    agent = dict(out.get("agent") or {})
    agent.setdefault("runtime", {"type": "subprocess"})
    out["agent"] = agent
    out.setdefault("interception", {"type": "server"})
    return out
