"""The exception hierarchy of ThunderSync.

Every exception the library raises on purpose derives from :class:`ThunderSyncError`, so an
application can catch the library's errors in one place. Errors caused by bad input also derive
from the matching builtin (``ValueError``, ``KeyError``, ``ImportError``), so generic handlers
keep working.

::

    ThunderSyncError
    ├── ConfigError (ValueError)            bad input: a value, a shape, an option
    │   ├── GraphError                      a stage graph that cannot be wired
    │   ├── DefinitionError                 a pipeline definition file, path-qualified
    │   └── EventError                      an event that cannot be decoded or encoded
    ├── MissingExtraError (ImportError)     an optional dependency is not installed
    ├── PipelineError                       the runtime of a stage graph
    │   └── StageFailed                     a stage raised; names the stage and the event
    ├── TrackerError                        misuse of the trajectory/group/batch state machines
    ├── StreamingError                      misuse of the streaming backward engine
    │   ├── UnknownIdError (KeyError)       a group or trajectory id that was never opened
    │   └── UnsafeStepError                 stepping while work is pending or parameters moved
    ├── KernelError                         GPU kernels and their capability probing
    │   └── KernelUnavailable               a kernel that was required cannot run here
    ├── DistributedError                    a rank died, stalled or disagreed with the others
    ├── EpisodeError                        an agent episode failed: names task, trajectory, tool, cause
    ├── GenerationError                     rollout generation backends
    │   └── BackendCapabilityError          a backend cannot do what was asked (e.g. token ids)
    ├── AgentAppError                       an agent app's request or episode that cannot be trained on as sampled
    └── SandboxError                        agent tool sandboxes
        ├── SandboxUnavailable              no backend/engine/image can be used
        ├── UnsafePathError                 a scratch/seed directory or path fails a safety check
        ├── SandboxExecError                an exec could not be carried out (not a non-zero exit)
        └── SandboxLimitError               a file or tree passes a sandbox's size bound

Messages say what happened, with the offending values, and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "AgentAppError",
    "BackendCapabilityError",
    "ConfigError",
    "DefinitionError",
    "DistributedError",
    "EpisodeError",
    "EventError",
    "GenerationError",
    "GraphError",
    "KernelError",
    "KernelUnavailable",
    "MissingExtraError",
    "PipelineError",
    "SandboxError",
    "SandboxExecError",
    "SandboxLimitError",
    "SandboxUnavailable",
    "StageFailed",
    "StreamingError",
    "ThunderSyncError",
    "TrackerError",
    "UnknownIdError",
    "UnsafePathError",
    "UnsafeStepError",
]


class ThunderSyncError(Exception):
    """Base class of every error raised on purpose by ThunderSync."""


# --- input and configuration -------------------------------------------------------------------


class ConfigError(ThunderSyncError, ValueError):
    """A value given to the library is invalid; the message names it and shows it."""


class GraphError(ConfigError):
    """A stage graph cannot be wired (unknown stage, dangling edge, duplicate name...)."""


class DefinitionError(ConfigError):
    """A pipeline definition file is invalid; the message starts with the path in the file."""


class EventError(ConfigError):
    """An event's wire form is invalid (a field's type or range, nesting) or cannot be encoded;
    the message names the field where msgspec can (``... - at `$.turn```)."""


class MissingExtraError(ThunderSyncError, ImportError):
    """An optional dependency is missing; the message gives the pip command that installs it
    (``alone``: the package that can also be installed by itself)."""

    def __init__(self, feature: str, extra: str, module: str, *, alone: str | None = None) -> None:
        either = f" (or pip install {alone})" if alone is not None else ""
        super().__init__(
            f"{feature} needs the {extra!r} extra (module {module!r} is not installed): "
            f"pip install 'thundersync[{extra}]'{either}"
        )
        self.feature = feature
        self.extra = extra
        self.module = module


# --- pipeline runtime --------------------------------------------------------------------------


class PipelineError(ThunderSyncError):
    """The stage-graph runtime failed."""


class StageFailed(PipelineError):
    """A stage raised while handling an event; the graph was cancelled. The message gives the cause
    first, then the event by its short fields (``ActionGenerated(group_id=0, trajectory_id=1, turn=0,
    ...)``: never its token ids).

    ``stage`` is the stage name, ``event`` the event it was handling (``None`` when it failed
    outside an event, e.g. a source), and ``__cause__`` the original exception.
    """

    def __init__(self, stage: str, event: object | None, cause: BaseException) -> None:
        handling = f"while handling {_event_label(event)}" if event is not None else "outside any event"
        super().__init__(f"stage {stage!r} failed: {type(cause).__name__}: {cause} ({handling})")
        self.stage = stage
        self.event = event


def _event_label(event: object, limit: int = 160) -> str:
    """An event by its class and its integer and text fields (ids, turn...), never its token lists: the cause
    of a failure, not the event, is what its message is read for."""
    fields = getattr(event, "__struct_fields__", None)
    if fields is None:
        return _bounded_repr(event, limit)
    shown = []
    for name in fields:
        value = getattr(event, name, None)
        if isinstance(value, (int, str)) and not isinstance(value, bool):  # ids, turn, step, version
            text = repr(value)
            shown.append(f"{name}={text if len(text) <= 40 else text[:37] + '...'}")
    label = f"{type(event).__name__}({', '.join(shown)})"
    return label if len(label) <= limit else label[: limit - 4] + "...)"


def _bounded_repr(value: object, limit: int = 300) -> str:
    """``repr(value)``, its middle elided past ``limit`` characters (events can hold many tokens)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    tail = limit // 4
    return f"{text[: limit - tail]} ...({len(text) - limit} characters elided)... {text[-tail:]}"


# --- dependency tracker ------------------------------------------------------------------------


class TrackerError(ThunderSyncError):
    """A trajectory, group or batch state machine was driven through an invalid transition."""


# --- streaming engine --------------------------------------------------------------------------


class StreamingError(ThunderSyncError):
    """The streaming backward engine was misused (closing twice, appending after close...)."""


class UnknownIdError(StreamingError, KeyError):
    """A group or trajectory id that is not open (never opened, or already closed)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnsafeStepError(StreamingError):
    """Stepping the optimizer now would not equal the synchronous update; says what is pending."""


# --- kernels -----------------------------------------------------------------------------------


class KernelError(ThunderSyncError):
    """A GPU kernel or its capability probing failed."""


class KernelUnavailable(KernelError):
    """A kernel was required (e.g. ``Acceleration.fa4 = "require"``, ``THUNDERSYNC_FA4=require``) but
    cannot run on this device."""


# --- rollout generation ------------------------------------------------------------------------


class DistributedError(ThunderSyncError):
    """Data-parallel training across ranks failed: a rank died or timed out, or ranks disagreed."""


class EpisodeError(ThunderSyncError):
    """An agent episode failed for a reason outside the model's text: its sandbox could not start or
    died, its task's setup or grading failed, a tool raised. The message names the task, the
    trajectory, the tool (or ``setup``, ``grader``) and the cause; ``on_failure`` (an
    :class:`~thundersync.scheduling.EpisodeFailures`) decides whether it fails the run. The
    message is the cause first, then ``(episode failed: task ..., trajectory ..., tool ...)``."""

    def __init__(self, *, task: str, trajectory: str, tool: str, cause: str) -> None:
        super().__init__(f"{cause} (episode failed: task {task}, {trajectory}, tool {tool!r})")
        self.task, self.trajectory, self.tool, self.cause = task, trajectory, tool, cause


class GenerationError(ThunderSyncError):
    """A generation backend failed."""


class BackendCapabilityError(GenerationError):
    """A generation backend cannot provide what was asked (token ids, log-probs, LoRA sync...)."""


# --- sandboxes ---------------------------------------------------------------------------------


class AgentAppError(ThunderSyncError):
    """An agent app (code written against an OpenAI client) asked for something that cannot be
    trained on exactly as sampled (a conversation that does not continue the last one, an option
    the endpoint does not serve), or its episode failed; ``status`` is the HTTP status the
    endpoint answers with."""

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class SandboxError(ThunderSyncError):
    """A tool sandbox failed."""


class SandboxUnavailable(SandboxError):
    """No sandbox backend, engine or image can be used; says which were tried and why."""


class UnsafePathError(SandboxError):
    """A scratch root, seed cache or copied path fails a safety check; says how to fix it."""


class SandboxExecError(SandboxError):
    """A command could not be run in the sandbox (a non-zero exit status is not an error)."""


class SandboxLimitError(SandboxError):
    """A file or working tree is larger than a sandbox's bound allows (or sparse); says which and how big."""
