"""The ``sandbox-tools`` factory of pipeline files: a :class:`SandboxToolRunner` by backend and tool names.

    [objects.tools]
    factory = "sandbox-tools"
    backend = "docker"                  # or "udocker"; "local" only for tools that run no model text
    image = "thundersync-agent/python:1"
    tools = ["view", "replace", "search", "shell", "submit"]
    max_sandboxes = 8                   # sandboxes in use at once (trajectories holding one)
    warm = 4                            # started before the first episode, kept warm

The ``local`` backend runs host processes: it is no isolation boundary, so it is refused for any
tool that runs what the model writes (``shell``, ``python``, ``search``) unless the file says
``allow_unsafe_local_sandbox = true``. Tasks may name their own image (``environment.image``) on
the container backends.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Literal

import msgspec

from thundersync.errors import ConfigError
from thundersync.sandboxes import NotIsolatedWarning, Sandbox, SandboxLimits, make_sandbox
from thundersync.tools.base import Tokenizer, ToolCallParser
from thundersync.tools.coding import SandboxTool, coding_tools
from thundersync.tools.commands import Tool, default_tools
from thundersync.tools.sandboxed import SandboxToolRunner

__all__ = ["ToolName", "sandbox_tools"]

ToolName = Literal["calculator", "python", "shell", "view", "create", "replace", "search", "submit"]

_Positive = Annotated[int, msgspec.Meta(ge=1)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Seconds = Annotated[float, msgspec.Meta(gt=0)]


def sandbox_tools(
    *,
    backend: Literal["docker", "udocker", "local"],
    image: str | None = None,
    tools: tuple[ToolName, ...] = ("calculator", "python", "shell"),
    max_sandboxes: _Positive = 4,
    warm: _NonNegative = 0,
    timeout_s: _Seconds = 10.0,
    truncate_tokens: _NonNegative = 256,
    max_calls: _Positive = 8,
    max_observation_tokens: _Positive = 4096,
    action_timeout_s: _Seconds | None = None,
    memory_bytes: _Positive = 512 * 2**20,
    tree_bytes: _Positive = 256 * 2**20,
    allow_unsafe_local_sandbox: bool = False,
    tokenizer: Tokenizer | None = None,
    parser: ToolCallParser | None = None,
) -> SandboxToolRunner:
    """A runner over ``backend`` sandboxes (see the module docstring); ``docker`` and ``udocker``
    need an ``image`` with what the tools run (``sh``, ``python3``, ``grep``). ``tokenizer`` (a
    ``tokenizer`` object) defaults to :class:`~thundersync.tools.ByteTokenizer`, ``parser`` (not
    settable in a file: ``chat-sandbox-tools`` gives its chat template's) to Qwen3's."""
    if backend != "local" and not image:
        raise ConfigError(f"the {backend} backend needs an image with sh and python3, e.g. image='python:3.12-slim'")
    available: dict[str, Tool | SandboxTool] = {**default_tools(), **coding_tools()}
    chosen = [available[name] for name in dict.fromkeys(tools)]
    unsafe = [tool.name for tool in chosen if getattr(tool, "runs_model_code", True)]
    if backend == "local" and unsafe and not allow_unsafe_local_sandbox:
        raise ConfigError(
            f"the local backend runs host processes (no isolation), and the tools {unsafe} run what the model "
            "writes; use backend = 'docker' or 'udocker', or set allow_unsafe_local_sandbox = true if you "
            "accept that (trusted tests only)"
        )
    limits = SandboxLimits(memory_bytes=memory_bytes, timeout_s=timeout_s, tree_bytes=tree_bytes)

    def make(name: str | None) -> Sandbox:
        with warnings.catch_warnings():
            if allow_unsafe_local_sandbox:  # the file said so: no warning per sandbox
                warnings.simplefilter("ignore", NotIsolatedWarning)
            return make_sandbox(backend, name, limits=limits)

    runner = SandboxToolRunner(
        lambda: make(image),
        images=make if backend != "local" else None,
        image=image or "",
        tokenizer=tokenizer,
        parser=parser,
        tools=chosen,
        max_sandboxes=max_sandboxes,
        warm=warm,
        timeout_s=timeout_s,
        truncate_tokens=truncate_tokens,
        max_calls=max_calls,
        max_observation_tokens=max_observation_tokens,
        action_timeout_s=action_timeout_s,
    )
    runner.backend = backend
    runner.allow_unsafe_local = allow_unsafe_local_sandbox
    return runner
