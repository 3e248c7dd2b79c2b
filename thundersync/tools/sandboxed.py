"""`SandboxToolRunner`: executes an action's tool calls in sandboxes from a :class:`SandboxPool`.

    runner = SandboxToolRunner(lambda: make_sandbox("docker", "python:3.12-slim"), tokenizer=tok)
    async with runner:                             # the tool-execute stage does this for its run
        result = await runner.run(action)          # ToolResult: observation tokens and flags

For each action, the parser (default :class:`~thundersync.tools.qwen.Qwen3ToolCallParser`) finds
the calls; they run one after the other in one sandbox of the pool, which is reset between actions
(nothing carries over from one turn to the next). Each call's output (stdout, then stderr, as the
sandbox bounds them in bytes, without trailing newlines) is cut to ``truncate_tokens`` tokens with
:func:`thundersync.sandboxes.truncate_tokens`, then a status line is added when the call did not
end cleanly; the parser writes the responses into the observation text, which the tokenizer encodes.

Nothing the model writes fails the run: a malformed call, an unknown tool or bad arguments answer
with an ``error: ...`` response and exit status :data:`MALFORMED_CALL_STATUS`; a timeout, a crash or a
killed process answers with its output and status. A sandbox that cannot start does fail the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Literal

import msgspec

from thundersync.errors import ConfigError, SandboxError
from thundersync.events import ActionGenerated
from thundersync.sandboxes import Sandbox, SandboxLimits, SandboxPool, make_sandbox, truncate_tokens
from thundersync.sandboxes.base import ExecResult
from thundersync.tools.base import ByteTokenizer, Tokenizer, ToolCall, ToolCallParser, ToolResult
from thundersync.tools.commands import Tool, default_tools
from thundersync.tools.qwen import Qwen3ToolCallParser

__all__ = ["MALFORMED_CALL_STATUS", "SandboxToolRunner", "sandbox_tools"]

MALFORMED_CALL_STATUS = 2
"""The exit status reported for a call that never ran (malformed, unknown tool, bad arguments),
as shells report a usage error."""


class _Outcome(msgspec.Struct, frozen=True):
    text: str
    exit_status: int | None = 0
    truncated: bool = False
    timed_out: bool = False


def _status_line(result: ExecResult, timeout_s: float) -> str:
    if result.timed_out:
        return f"\n[killed: timed out after {timeout_s:g}s]"
    if result.killed_for_output:
        return "\n[killed: too much output]"
    if result.exit_code is None:
        return "\n[killed]"
    return f"\n[exit status {result.exit_code}]" if result.exit_code != 0 else ""


def _combined(outcomes: Sequence[_Outcome]) -> tuple[int | None, bool, bool]:
    """Exit status (None if a call was killed, else the first non-zero one, else 0), truncated, timed out."""
    statuses = [o.exit_status for o in outcomes]
    status = None if None in statuses else next((s for s in statuses if s), 0)
    return status, any(o.truncated for o in outcomes), any(o.timed_out for o in outcomes)


class SandboxToolRunner:
    """Runs named tools in pooled sandboxes; see the module docstring.

    ``sandbox`` makes one not-yet-started sandbox (as :class:`SandboxPool` takes it); at most
    ``max_sandboxes`` run at once. ``tools`` defaults to ``calculator``, ``python`` and ``shell``.
    """

    def __init__(
        self,
        sandbox: Callable[[], Sandbox],
        *,
        tokenizer: Tokenizer | None = None,
        parser: ToolCallParser | None = None,
        tools: Iterable[Tool] | None = None,
        max_sandboxes: int = 4,
        timeout_s: float = 10.0,
        truncate_tokens: int = 256,
    ) -> None:
        if max_sandboxes < 1 or timeout_s <= 0 or truncate_tokens < 0:
            raise ConfigError(
                f"SandboxToolRunner needs max_sandboxes >= 1, timeout_s > 0 and truncate_tokens >= 0; "
                f"got {max_sandboxes}, {timeout_s}, {truncate_tokens}"
            )
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.parser: ToolCallParser = parser if parser is not None else Qwen3ToolCallParser(self.tokenizer)
        self.tools: Mapping[str, Tool] = default_tools() if tools is None else {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.truncate_tokens = truncate_tokens
        self._sandbox = sandbox
        self._max_sandboxes = max_sandboxes
        self._pool: SandboxPool | None = None
        self._opened = 0  # open contexts: `thundersync run` enters its objects and tool-execute its runner

    async def __aenter__(self) -> SandboxToolRunner:
        """Open the pool, or join the context that opened it; the last exit closes it."""
        if self._pool is None:
            self._pool = SandboxPool(self._sandbox, max_size=self._max_sandboxes)
        self._opened += 1
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._opened -= 1
        if self._opened == 0:
            pool, self._pool = self._pool, None
            if pool is not None:
                await pool.aclose()

    async def run(self, action: ActionGenerated) -> ToolResult:
        calls = self.parser.parse(action.token_ids)
        outcomes = await self._outcomes(calls)
        status, truncated, timed_out = _combined(outcomes)
        text = self.parser.observation([o.text for o in outcomes])
        return ToolResult(
            token_ids=list(self.tokenizer.encode(text)), exit_status=status, truncated=truncated, timed_out=timed_out
        )

    async def _outcomes(self, calls: Sequence[ToolCall]) -> list[_Outcome]:
        checked = [self._check(call) for call in calls]
        if all(isinstance(c, _Outcome) for c in checked):
            return [c for c in checked if isinstance(c, _Outcome)]  # nothing to run: no sandbox needed
        if self._pool is None:
            raise SandboxError("the SandboxToolRunner is not open: use 'async with runner' (tool-execute does)")
        async with self._pool.acquire() as sandbox:
            return [c if isinstance(c, _Outcome) else await self._execute(sandbox, *c) for c in checked]

    def _check(self, call: ToolCall) -> _Outcome | tuple[Tool, Mapping[str, object]]:
        """The tool and arguments to run, or the error response of a call that cannot run."""
        if call.error is not None:
            return _Outcome(f"error: {call.error}", MALFORMED_CALL_STATUS)
        tool = self.tools.get(call.name)
        if tool is None:
            return _Outcome(
                f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}", MALFORMED_CALL_STATUS
            )
        return tool, call.arguments

    async def _execute(self, sandbox: Sandbox, tool: Tool, arguments: Mapping[str, object]) -> _Outcome:
        try:
            command = tool.command(arguments)
        except ValueError as error:
            return _Outcome(f"error: {error}", MALFORMED_CALL_STATUS)
        result = await sandbox.exec(command.argv, timeout=self.timeout_s, stdin=command.stdin)
        output = (result.stdout + result.stderr).rstrip("\n")
        shown = truncate_tokens(output, self.tokenizer, self.truncate_tokens)
        return _Outcome(
            (shown or "(no output)") + _status_line(result, self.timeout_s),
            result.exit_code,
            truncated=result.truncated or result.killed_for_output or shown != output,
            timed_out=result.timed_out,
        )


_Positive = Annotated[int, msgspec.Meta(ge=1)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Seconds = Annotated[float, msgspec.Meta(gt=0)]


def sandbox_tools(
    *,
    backend: Literal["docker", "udocker", "local"],
    image: str | None = None,
    tools: tuple[Literal["calculator", "python", "shell"], ...] = ("calculator", "python", "shell"),
    max_sandboxes: _Positive = 4,
    timeout_s: _Seconds = 10.0,
    truncate_tokens: _NonNegative = 256,
    memory_bytes: _Positive = 512 * 2**20,
    tokenizer: Tokenizer | None = None,
) -> SandboxToolRunner:
    """The ``sandbox-tools`` factory of pipeline files: a runner over ``backend`` sandboxes.

    ``local`` runs host processes (not an isolation boundary: tests and trusted tools only);
    ``docker`` and ``udocker`` need an ``image`` with ``sh`` and ``python3``. ``tokenizer`` (not
    settable in a file yet) defaults to :class:`ByteTokenizer`.
    """
    limits = SandboxLimits(memory_bytes=memory_bytes, timeout_s=timeout_s)
    if backend != "local" and not image:
        raise ConfigError(f"the {backend} backend needs an image with sh and python3, e.g. image='python:3.12-slim'")
    available = default_tools()
    return SandboxToolRunner(
        lambda: make_sandbox(backend, image, limits=limits),
        tokenizer=tokenizer,
        tools=[available[name] for name in dict.fromkeys(tools)],
        max_sandboxes=max_sandboxes,
        timeout_s=timeout_s,
        truncate_tokens=truncate_tokens,
    )
