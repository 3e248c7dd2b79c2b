"""`SandboxToolRunner`: runs an action's tool calls in its trajectory's own sandbox.

    runner = SandboxToolRunner(lambda: make_sandbox("docker", "python:3.12-slim"), tokenizer=tok)
    async with runner:                              # the tool-execute stage does this for its run
        result = await runner.run_turn(action, task)  # ToolResult: observation tokens and flags
        await runner.trajectory_ended(group_id, trajectory_id)   # or trajectory_closed (close stage)

A trajectory gets one sandbox when its first call needs one and keeps it for all its turns
(:class:`~thundersync.tools.sessions.TrajectorySandboxes`: its task's image and content, pools
keyed by image, ``warm`` sandboxes of the runner's image started on entry); it is reset and given
back when the trajectory's final action goes by, or, once a close stage holds the runner
(``release_at("close")``), when the trajectory is graded (its reward came) or closes, so that a
grader can still use it.

For each action the parser (default :class:`~thundersync.tools.qwen.Qwen3ToolCallParser`) finds
the calls; they run one after the other. Each call's output (stdout, then stderr, as the sandbox
bounds them in bytes, without trailing newlines) is cut to ``truncate_tokens`` tokens with
:func:`thundersync.sandboxes.truncate_tokens`, a status line is added when the call did not end
cleanly, the parser writes the responses into the observation, which is cut again to
``max_observation_bytes`` and ``max_observation_tokens``. At most ``max_calls`` calls of an action
run, all of them within ``action_timeout_s``; the others answer that they were not run.

Nothing the model writes fails the run: a malformed call, an unknown tool, bad arguments, a tool
that raises on them, a parser that raises, a timeout, a crash or a killed process answer with an
``error: ...`` response (exit status :data:`MALFORMED_CALL_STATUS` for calls that never ran).
A sandbox that cannot start or dies, or a task whose content or setup fails, raises
:class:`~thundersync.errors.EpisodeError` naming task, trajectory, tool and cause: the stage's
``on_failure`` decides what follows (:class:`~thundersync.scheduling.EpisodeFailures`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec

from thundersync._logging import get_logger
from thundersync.errors import ConfigError, EpisodeError, SandboxError, SandboxLimitError, UnsafePathError
from thundersync.events import ActionGenerated
from thundersync.sandboxes import Sandbox, SandboxPools, truncate_tokens
from thundersync.sandboxes.base import ExecResult
from thundersync.tools.base import ByteTokenizer, Tokenizer, ToolCall, ToolCallParser, ToolResult, safe_repr
from thundersync.tools.coding import SandboxTool, ToolOutput
from thundersync.tools.commands import Tool, default_tools
from thundersync.tools.qwen import Qwen3ToolCallParser
from thundersync.tools.sessions import SandboxSlots, TrajectorySandboxes
from thundersync.tools.workspace import TaskEnvironment, Workspaces, environment_of, task_name

__all__ = ["MALFORMED_CALL_STATUS", "SandboxToolRunner"]

log = get_logger("thundersync.tools")

MALFORMED_CALL_STATUS = 2
"""The exit status reported for a call that never ran (malformed, unknown tool, bad arguments, over
the action's bounds), as shells report a usage error."""


class _Outcome(msgspec.Struct, frozen=True):
    text: str
    exit_status: int | None = 0
    truncated: bool = False
    timed_out: bool = False
    malformed: bool = False
    killed: bool = False
    submitted: bool = False


def _refused(text: str) -> _Outcome:
    return _Outcome(f"error: {text}", MALFORMED_CALL_STATUS, malformed=True)


def _status_line(result: ExecResult, timeout_s: float) -> str:
    if result.timed_out:
        return f"\n[killed: timed out after {timeout_s:g}s]"
    if result.killed_for_output:
        return "\n[killed: too much output]"
    if result.exit_code is None:
        return "\n[killed]"
    return f"\n[exit status {result.exit_code}]" if result.exit_code != 0 else ""


def _combined(outcomes: Sequence[_Outcome]) -> ToolResult:
    """Exit status (None if a call was killed, else the first non-zero one, else 0) and the flags."""
    statuses = [o.exit_status for o in outcomes]
    return ToolResult(
        token_ids=[],
        exit_status=None if None in statuses else next((s for s in statuses if s), 0),
        truncated=any(o.truncated for o in outcomes),
        timed_out=any(o.timed_out for o in outcomes),
        malformed=sum(o.malformed for o in outcomes),
        killed=any(o.killed for o in outcomes),
        submitted=any(o.submitted for o in outcomes),
    )


class SandboxToolRunner:
    """Runs named tools in per-trajectory sandboxes; see the module docstring.

    ``sandbox`` makes a not-yet-started sandbox of the runner's own image (``image``, its name);
    ``images`` (optional) makes one of any image a task names. At most ``max_sandboxes`` run at
    once; ``warm`` of the runner's image start on entry; graders take fresh sandboxes from pools of
    their own (``grade_sandboxes``, default ``max_sandboxes``), never from the trajectories'. ``tools`` defaults to ``calculator``,
    ``python`` and ``shell``; :mod:`~thundersync.tools.coding` has the coding tools.
    """

    def __init__(
        self,
        sandbox: Callable[[], Sandbox] | None = None,
        *,
        images: Callable[[str], Sandbox] | None = None,
        image: str = "",
        tokenizer: Tokenizer | None = None,
        parser: ToolCallParser | None = None,
        tools: Iterable[Tool | SandboxTool] | None = None,
        max_sandboxes: int = 4,
        warm: int = 0,
        grade_sandboxes: int | None = None,
        timeout_s: float = 10.0,
        truncate_tokens: int = 256,
        max_calls: int = 8,
        max_observation_bytes: int = 64 * 1024,
        max_observation_tokens: int = 4096,
        action_timeout_s: float | None = None,
    ) -> None:
        bounds = (max_sandboxes, max_calls, max_observation_bytes, max_observation_tokens)
        if sandbox is None and images is None:
            raise ConfigError("SandboxToolRunner needs a sandbox factory (sandbox=...) or one per image (images=...)")
        if min(bounds) < 1 or timeout_s <= 0 or truncate_tokens < 0 or not 0 <= warm <= max_sandboxes:
            raise ConfigError(
                "SandboxToolRunner needs max_sandboxes, max_calls, max_observation_bytes and max_observation_tokens "
                f">= 1, 0 <= warm <= max_sandboxes, timeout_s > 0 and truncate_tokens >= 0; got {bounds}, warm={warm}, "
                f"timeout_s={timeout_s}, truncate_tokens={truncate_tokens}"
            )
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.parser: ToolCallParser = parser if parser is not None else Qwen3ToolCallParser(self.tokenizer)
        self.tools: Mapping[str, Tool | SandboxTool] = default_tools() if tools is None else {t.name: t for t in tools}
        self.timeout_s, self.truncate_tokens, self.max_calls = timeout_s, truncate_tokens, max_calls
        self.max_observation_bytes, self.max_observation_tokens = max_observation_bytes, max_observation_tokens
        self.action_timeout_s = action_timeout_s if action_timeout_s is not None else 4 * timeout_s
        self.image = image
        self.backend = "custom"  # the sandbox-tools factory names its backend here
        self.allow_unsafe_local = False  # and whether the file accepted model code on the local backend
        self._factory = (sandbox, images)
        self._max_sandboxes, self._warm = max_sandboxes, warm
        self._grade_sandboxes = grade_sandboxes if grade_sandboxes is not None else max_sandboxes
        self._release_at: Literal["end", "close"] = "end"
        self._slots: SandboxSlots | None = None
        self._sessions: TrajectorySandboxes | None = None
        self._opened = 0  # open contexts: `thundersync run` enters its objects and tool-execute its runner

    # -- life cycle ---------------------------------------------------------------------------

    def _make(self, key: Hashable) -> Sandbox:
        sandbox, images = self._factory
        if key == self.image and sandbox is not None:
            return sandbox()
        assert images is not None
        return images(str(key))

    async def __aenter__(self) -> SandboxToolRunner:
        """Open the pools (warm sandboxes start here), or join the context that opened them."""
        if self._sessions is None:
            warm: dict[Hashable, int] | None = {self.image: self._warm} if self._warm else None
            pools = SandboxPools(self._make, max_size=self._max_sandboxes, warm=warm)
            grading = SandboxPools(self._make, max_size=max(1, self._grade_sandboxes))
            sessions = TrajectorySandboxes(
                pools, Workspaces(), default_image=self.image, images=self._factory[1] is not None, grading=grading
            )
            sessions.slots = self._slots
            await sessions.workspaces.__aenter__()
            try:
                await pools.__aenter__()
            except BaseException:
                await sessions.workspaces.__aexit__(None, None, None)
                raise
            self._sessions = sessions
        self._opened += 1
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._opened -= 1
        if self._opened == 0:
            sessions, self._sessions = self._sessions, None
            if sessions is not None:
                try:
                    await sessions.aclose()
                    await sessions.pools.aclose()
                    await sessions.grading.aclose()
                finally:
                    await sessions.workspaces.__aexit__(None, None, None)

    @property
    def sessions(self) -> TrajectorySandboxes:
        """The trajectories' sandboxes (graders use them); only while the runner is open."""
        if self._sessions is None:
            raise SandboxError("the SandboxToolRunner is not open: use 'async with runner' (tool-execute does)")
        return self._sessions

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, in the runner's order: what a prompt publishes to the model
        (:func:`~thundersync.tools.prompts.tool_prompt`)."""
        return [tool.schema for tool in self.tools.values()]

    def use_slots(self, slots: SandboxSlots | None) -> None:
        """Hold one of ``slots`` for each trajectory from its sandbox's acquisition to its release."""
        self._slots = slots
        if self._sessions is not None:
            self._sessions.slots = slots

    def release_at(self, when: Literal["end", "close"]) -> None:
        if when not in ("end", "close"):
            raise ConfigError(f"release_at takes 'end' or 'close', got {when!r}")
        self._release_at = when

    @property
    def releases_at(self) -> Literal["end", "close"]:
        return self._release_at

    async def trajectory_ended(self, group_id: Hashable, trajectory_id: Hashable) -> None:
        if self._release_at == "end" and self._sessions is not None:
            await self._sessions.release((group_id, trajectory_id))

    async def trajectory_closed(self, group_id: Hashable, trajectory_id: Hashable) -> None:
        if self._sessions is not None:
            await self._sessions.release((group_id, trajectory_id))

    # -- one action ---------------------------------------------------------------------------

    async def run(self, action: ActionGenerated) -> ToolResult:
        """:meth:`run_turn` for a task without fields (the runner's image, an empty tree)."""
        return await self.run_turn(action, {})

    async def run_turn(self, action: ActionGenerated, task: Mapping[str, Any]) -> ToolResult:
        calls = self._parse(action.token_ids)
        key = (action.group_id, action.trajectory_id)
        label = task_name(task, action.group_id)
        try:
            env = environment_of(task)
        except ConfigError as error:
            trajectory = f"trajectory {action.trajectory_id!r} of group {action.group_id!r}"
            raise EpisodeError(task=label, trajectory=trajectory, tool="setup", cause=str(error)) from None
        outcomes = await self._outcomes(calls, key, env, label)
        result = _combined(outcomes)
        ids = self._bounded_ids(self._bounded(self._observation([o.text for o in outcomes])))
        return msgspec.structs.replace(result, token_ids=ids)

    def _parse(self, token_ids: Sequence[int]) -> list[ToolCall]:
        try:
            return list(self.parser.parse(token_ids))
        except Exception as error:  # a parser must never fail the run on model text
            return [
                ToolCall(error=f"the tool call could not be parsed: {type(error).__name__}: {safe_repr(str(error))}")
            ]

    def _observation(self, responses: list[str]) -> str:
        try:
            return self.parser.observation(responses)
        except Exception:
            return "\n".join(responses)

    def _bounded(self, text: str) -> str:
        """``text`` cut to ``max_observation_bytes`` (head and tail, a marker between)."""
        data = text.encode("utf-8")
        if len(data) <= self.max_observation_bytes:
            return text
        half = self.max_observation_bytes // 2
        cut = len(data) - 2 * half
        return (data[:half] + f"\n...[{cut} bytes cut]...\n".encode() + data[-half:]).decode("utf-8", "replace")

    def _bounded_ids(self, text: str) -> list[int]:
        """The observation's token ids, at most ``max_observation_tokens`` of them, marker included
        (head and tail ids kept: the chat template's closing tokens survive)."""
        ids = list(self.tokenizer.encode(text))
        limit = self.max_observation_tokens
        if len(ids) <= limit:
            return ids
        marker = list(self.tokenizer.encode(f"\n[... {len(ids) - limit} tokens cut ...]\n"))[:limit]
        keep = limit - len(marker)
        return ids[: keep // 2] + marker + ids[len(ids) - (keep - keep // 2) :]

    async def _outcomes(
        self, calls: Sequence[ToolCall], key: tuple[Hashable, Hashable], env: TaskEnvironment | None, label: str
    ) -> list[_Outcome]:
        deadline = time.monotonic() + self.action_timeout_s
        outcomes: list[_Outcome] = []
        for index, call in enumerate(calls):
            left = deadline - time.monotonic()
            if index >= self.max_calls:
                outcomes.append(_refused(f"not run: an action may make at most {self.max_calls} tool calls"))
            elif any(o.submitted for o in outcomes):
                outcomes.append(_refused("not run: the episode was submitted by an earlier call"))
            elif left <= 0:
                outcomes.append(_refused(f"not run: the action's tool time ({self.action_timeout_s:g}s) is spent"))
            else:
                outcomes.append(await self._call(call, key, env, label, min(self.timeout_s, left)))
        return outcomes

    async def _call(
        self, call: ToolCall, key: tuple[Hashable, Hashable], env: TaskEnvironment | None, label: str, timeout: float
    ) -> _Outcome:
        if call.error is not None:
            return _refused(call.error)
        tool = self.tools.get(call.name)
        if tool is None:
            return _refused(f"unknown tool {safe_repr(call.name)}; tools: {', '.join(sorted(self.tools))}")
        trajectory = f"trajectory {key[1]!r} of group {key[0]!r}"
        if self._sessions is None and (not isinstance(tool, SandboxTool) or tool.needs_sandbox):
            raise SandboxError("the SandboxToolRunner is not open: use 'async with runner' (tool-execute does)")
        try:
            if isinstance(tool, SandboxTool):
                return await self._run_sandbox_tool(tool, call.arguments, key, env, label, timeout)
            return await self._run_command(tool, call.arguments, key, env, label, timeout)
        except EpisodeError:
            raise
        except SandboxLimitError as error:  # the model's files passed the tree bound: its processes were killed
            return _Outcome(f"error: {error}", None, killed=True)
        except UnsafePathError as error:
            return _refused(str(error))
        except SandboxError as error:
            raise EpisodeError(task=label, trajectory=trajectory, tool=call.name, cause=str(error)) from error

    async def _session_sandbox(
        self, key: tuple[Hashable, Hashable], env: TaskEnvironment | None, label: str
    ) -> Sandbox:
        return (await self.sessions.get(key, env, task=label)).sandbox

    async def _run_sandbox_tool(
        self,
        tool: SandboxTool,
        arguments: Mapping[str, Any],
        key: tuple[Hashable, Hashable],
        env: TaskEnvironment | None,
        label: str,
        timeout: float,
    ) -> _Outcome:
        sandbox = await self._session_sandbox(key, env, label) if tool.needs_sandbox else None
        try:
            out: ToolOutput = await tool.run(sandbox, arguments, timeout_s=timeout)
        except (SandboxError, EpisodeError):
            raise
        except Exception as error:  # bad arguments (ValueError), or a tool that raised on them
            return self._tool_error(tool.name, error)
        return self._shown(out.text, out.exit_status, out.truncated, out.timed_out, submitted=out.submitted)

    async def _run_command(
        self,
        tool: Tool,
        arguments: Mapping[str, Any],
        key: tuple[Hashable, Hashable],
        env: TaskEnvironment | None,
        label: str,
        timeout: float,
    ) -> _Outcome:
        try:
            command = tool.command(arguments)
        except Exception as error:
            return self._tool_error(tool.name, error)
        sandbox = await self._session_sandbox(key, env, label)
        try:
            result = await sandbox.exec(command.argv, timeout=timeout, stdin=command.stdin)
        except ConfigError as error:  # the sandbox refused an argv word the model wrote (a NUL byte...)
            return _refused(str(error))
        output = (result.stdout + result.stderr).rstrip("\n")
        return self._shown(
            output,
            result.exit_code,
            result.truncated or result.killed_for_output,
            result.timed_out,
            status=_status_line(result, timeout),
        )

    def _shown(
        self,
        output: str,
        exit_status: int | None,
        truncated: bool,
        timed_out: bool,
        *,
        status: str = "",
        submitted: bool = False,
    ) -> _Outcome:
        shown = truncate_tokens(output, self.tokenizer, self.truncate_tokens)
        return _Outcome(
            (shown or "(no output)") + status,
            exit_status,
            truncated=truncated or shown != output,
            timed_out=timed_out,
            killed=exit_status is None,
            submitted=submitted,
        )

    @staticmethod
    def _tool_error(name: str, error: Exception) -> _Outcome:
        if isinstance(error, ValueError) and not isinstance(error, SandboxError):
            return _refused(str(error)[:2000])
        log.warning("a tool raised on the model's arguments", tool=name, error=safe_repr(error, 300))
        return _Outcome(
            f"error: the {name} tool failed: {type(error).__name__}: {safe_repr(str(error), 300)}", None, killed=True
        )
