"""Fakes that users and our own tests share, so a whole stage graph runs with no model.

Each fake is deterministic (same inputs, same outputs) and satisfies the same protocol as the real
runtime object it stands in for::

    ScriptedSource       a source stage that emits given events (prompts: stages.source.SourceStage)
    ScriptedGenerator    thundersync.generation.base.Generator: token ids in, tokens + log-probs out
    ScriptedReplies      thundersync.generation.base.Generator: given texts, turn by turn
    ScriptedTool         thundersync.tools.ToolCallParser and ToolRunner: observation tokens
    FakeScorer           thundersync.stages.reward.Scorer: a reward computed from the tokens
    FakeTeacher          thundersync.stages.teacher.Teacher: teacher log-probs per token
    RecordingTrainer     thundersync.stages.step.Trainer: records each step it is asked for
    FakeSandbox          thundersync.sandboxes.Sandbox: files in memory, scripted commands

``delay_s`` on each fake simulates latency (``anyio.sleep``); with 0 it still yields to the event
loop once per call, like real I/O would.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, ClassVar

import anyio
import msgspec
from anyio.lowlevel import checkpoint

from thundersync.errors import UnsafePathError
from thundersync.events import EVENT_TYPES, ActionGenerated, BatchReady, EventBase
from thundersync.generation.base import GenerationRequest, GenerationResult
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.sandboxes.base import ExecResult
from thundersync.stages.step import StepResult
from thundersync.tools import ByteTokenizer, Tokenizer, ToolCall, ToolResult

__all__ = [
    "FakeSandbox",
    "FakeScorer",
    "FakeTeacher",
    "RecordingTrainer",
    "ScriptedGenerator",
    "ScriptedReplies",
    "ScriptedSource",
    "ScriptedTool",
    "even_token_fraction",
]


_Count = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]
_Seconds = Annotated[float, msgspec.Meta(ge=0)]
# (pipeline files validate factory arguments against these annotations; Python callers get _at_least)


def _at_least(low: float, **values: float) -> None:
    for name, value in values.items():
        if not value >= low:
            raise ValueError(f"{name} must be >= {low}, got {value!r}")


async def _pause(delay_s: float) -> None:
    if delay_s > 0:
        await anyio.sleep(delay_s)
    else:
        await checkpoint()


def _rng(*parts: object) -> random.Random:
    return random.Random(zlib.crc32(repr(parts).encode()))


class ScriptedSource(Stage):
    """A source stage that sends ``events`` in order (e.g. to drive one stage in a test)."""

    produces: ClassVar[tuple[type[EventBase], ...]] = tuple(EVENT_TYPES.values())

    class Config(Stage.Config, frozen=True):
        delay_s: float = 0.0

    config: Config

    def __init__(self, config: Config | None = None, /, *, events: Iterable[EventBase]) -> None:
        super().__init__(config)
        self.events = list(events)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        for event in self.events:
            await _pause(self.config.delay_s)
            await outbox.send(event)


class ScriptedGenerator:
    """Deterministic tokens and log-probs derived from the request (prompt ids and seed).

    Each call returns between ``min_new_tokens`` and ``params.max_new_tokens`` token ids below
    ``vocab_size`` (stopping early after a token in ``params.stop_token_ids``) and one log-prob in
    [-3.05, -0.05) per token. ``requests`` records every request in call order.
    """

    def __init__(self, *, vocab_size: _Positive = 1000, min_new_tokens: _Count = 1, delay_s: _Seconds = 0.0) -> None:
        _at_least(1, vocab_size=vocab_size)
        _at_least(0, min_new_tokens=min_new_tokens, delay_s=delay_s)
        self.vocab_size = vocab_size
        self.min_new_tokens = min_new_tokens
        self.delay_s = delay_s
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        await _pause(self.delay_s)
        params = request.params
        rng = _rng(request.prompt_ids, params.seed)
        length = rng.randint(min(self.min_new_tokens, params.max_new_tokens), params.max_new_tokens)
        tokens: list[int] = []
        for _ in range(length):
            tokens.append(rng.randrange(self.vocab_size))
            if tokens[-1] in params.stop_token_ids:
                break
        stopped = bool(tokens) and tokens[-1] in params.stop_token_ids
        return GenerationResult(
            token_ids=tokens,
            logprobs=[-0.05 - 3.0 * rng.random() for _ in tokens],
            finish_reason="stop" if stopped else "length",
            prompt_len=len(request.prompt_ids),
        )

    def allow_weight_changes(self) -> None:
        """A scripted generator has no weights: any ``max_staleness`` is fine."""


class ScriptedReplies:
    """A generator that answers turn ``k`` of every trajectory with ``replies[k]`` (the last reply
    once they run out), encoded by ``tokenizer`` (default :class:`~thundersync.tools.ByteTokenizer`),
    each token with log-prob ``logprob``. Turns are counted per ``session_id``."""

    def __init__(
        self, *, replies: list[str], tokenizer: Tokenizer | None = None, logprob: float = -1.0, delay_s: _Seconds = 0.0
    ) -> None:
        if not replies:
            raise ValueError("ScriptedReplies needs at least one reply")
        _at_least(0, delay_s=delay_s)
        self.replies = list(replies)
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.logprob = logprob
        self.delay_s = delay_s
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        turn = sum(r.session_id == request.session_id for r in self.requests)
        self.requests.append(request)
        await _pause(self.delay_s)
        tokens = list(self.tokenizer.encode(self.replies[min(turn, len(self.replies) - 1)]))
        return GenerationResult(
            token_ids=tokens,
            logprobs=[self.logprob] * len(tokens),
            finish_reason="stop",
            prompt_len=len(request.prompt_ids),
        )

    def allow_weight_changes(self) -> None:
        """Scripted replies have no weights: any ``max_staleness`` is fine."""


class ScriptedTool:
    """Every action calls a tool unless it contains ``end_token``; the observation is
    ``observation_len`` tokens derived from the action. It is both the parser generate asks and
    the runner tool-execute runs."""

    def __init__(
        self,
        *,
        observation_len: _Count = 3,
        vocab_size: _Positive = 1000,
        end_token: _Count | None = None,
        delay_s: _Seconds = 0.0,
    ) -> None:
        _at_least(1, vocab_size=vocab_size)
        _at_least(0, observation_len=observation_len, delay_s=delay_s)
        self.observation_len = observation_len
        self.vocab_size = vocab_size
        self.end_token = end_token
        self.delay_s = delay_s

    def parse(self, token_ids: Sequence[int]) -> list[ToolCall]:
        """One call named ``scripted`` unless the action contains ``end_token``."""
        return [ToolCall(name="scripted")] if self.end_token is None or self.end_token not in token_ids else []

    def observation(self, responses: Sequence[str]) -> str:
        return "\n".join(responses)

    async def run(self, action: ActionGenerated) -> ToolResult:
        await _pause(self.delay_s)
        rng = _rng(action.token_ids)
        return ToolResult(token_ids=[rng.randrange(self.vocab_size) for _ in range(self.observation_len)])


def even_token_fraction(prompt_ids: list[int], completion_ids: list[int]) -> float:
    """The default fake reward: the fraction of completion tokens that are even (0 when empty)."""
    return sum(t % 2 == 0 for t in completion_ids) / len(completion_ids) if completion_ids else 0.0


class FakeScorer:
    """A reward computed from the tokens by ``fn`` (default :func:`even_token_fraction`)."""

    def __init__(
        self, *, fn: Callable[[list[int], list[int]], float] = even_token_fraction, delay_s: _Seconds = 0.0
    ) -> None:
        self.fn = fn
        self.delay_s = delay_s
        self.calls: list[tuple[list[int], list[int]]] = []

    async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> float:
        self.calls.append((list(prompt_ids), list(completion_ids)))
        await _pause(self.delay_s)
        return self.fn(prompt_ids, completion_ids)


class FakeTeacher:
    """Teacher log-probs that depend on the token and its absolute position only::

    q(token y at position p) = -(((31 * p + 17 * y) mod 101) + 1) / 25      in [-4.04, -0.04]
    """

    def __init__(self, *, delay_s: _Seconds = 0.0) -> None:
        self.delay_s = delay_s

    @staticmethod
    def logprob(position: int, token: int) -> float:
        return -(((31 * position + 17 * token) % 101) + 1) / 25

    async def logprobs(self, context_ids: list[int], token_ids: list[int]) -> list[float]:
        await _pause(self.delay_s)
        return [self.logprob(len(context_ids) + i, token) for i, token in enumerate(token_ids)]


class RecordingTrainer:
    """Records each batch it steps on; reports the batch's scored-token count as ``grad_norm``."""

    def __init__(self, *, delay_s: _Seconds = 0.0) -> None:
        self.delay_s = delay_s
        self.steps: list[BatchReady] = []

    async def step(self, ready: BatchReady) -> StepResult:
        await _pause(self.delay_s)
        self.steps.append(ready)
        return StepResult(grad_norm=float(ready.num_scored_tokens))


Command = Callable[["FakeSandbox", list[str], "bytes | None"], ExecResult]


class FakeSandbox:
    """A sandbox whose working tree is a dict of files and whose commands are answered by
    ``run(sandbox, argv, stdin)`` (default: exit 0, no output); ``reset()`` puts the files back to
    ``files`` and returns ``reset_ok``. Each command takes ``delay_s`` (past its timeout it is
    killed: ``timed_out``, no exit status). ``log`` records each call (``"exec sh -c ..."``, ``"reset"``,
    ``"close"``). A path outside the tree, or one with no file, raises
    :class:`~thundersync.errors.UnsafePathError` as the real backends do."""

    made = 0

    def __init__(
        self,
        *,
        files: Mapping[str, bytes] | None = None,
        run: Command | None = None,
        reset_ok: bool = True,
        workdir: str = "/work",
        delay_s: float = 0.0,
    ) -> None:
        FakeSandbox.made += 1
        self.name = f"fake-{FakeSandbox.made}"
        self.workdir = workdir
        self.seed = dict(files or {})
        self.files = dict(self.seed)
        self.run = run
        self.reset_ok = reset_ok
        self.delay_s = delay_s
        self.log: list[str] = []
        self.closed = False

    @property
    def tree(self) -> Path:
        return Path("/nonexistent") / self.name

    async def __aenter__(self) -> FakeSandbox:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @staticmethod
    def _path(path: str | bytes) -> str:
        text = path.decode() if isinstance(path, bytes) else path
        parts = [p for p in text.split("/") if p not in ("", ".")]
        if text.startswith("/") or ".." in parts or not parts:
            raise UnsafePathError(f"path {path!r} must be relative to the working tree, without '..'")
        return "/".join(parts)

    async def exec(
        self,
        cmd: Sequence[str] | str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        self.log.append("exec " + " ".join(argv))
        if timeout is not None and self.delay_s > timeout:
            await anyio.sleep(timeout)
            return ExecResult(exit_code=None, stdout="", stderr="", timed_out=True)
        await _pause(self.delay_s)
        return self.run(self, argv, stdin) if self.run is not None else ExecResult(exit_code=0, stdout="", stderr="")

    async def write_file(self, path: str | bytes, data: bytes) -> None:
        self.files[self._path(path)] = bytes(data)

    async def read_file(self, path: str | bytes) -> bytes:
        key = self._path(path)
        if key not in self.files:
            raise UnsafePathError(f"cannot use {key!r} in the working tree: No such file or directory")
        return self.files[key]

    async def copy_in(self, src: Path, dest: str | bytes) -> None:
        root, base = Path(src), self._path(dest)
        if root.is_file():
            self.files[base] = root.read_bytes()
            return
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                self.files[f"{base}/{path.relative_to(root).as_posix()}"] = path.read_bytes()

    async def copy_out(self, src: str | bytes, dest: Path) -> None:
        for name, data in self.files.items():
            target = Path(dest) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    async def reset(self) -> bool:
        self.log.append("reset")
        self.files = dict(self.seed)
        await checkpoint()
        return self.reset_ok

    async def close(self) -> None:
        self.log.append("close")
        self.closed = True
