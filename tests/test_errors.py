"""The exception hierarchy: builtin bases for bad input, readable messages."""

from __future__ import annotations

from thundersync import errors
from thundersync.events import ActionGenerated


def test_every_error_derives_from_thundersync_error() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.ThunderSyncError), name


def test_input_errors_keep_their_builtin_bases() -> None:
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.DefinitionError, ValueError)
    assert issubclass(errors.EventError, ValueError)
    assert issubclass(errors.UnknownIdError, KeyError)
    assert issubclass(errors.MissingExtraError, ImportError)


def test_missing_extra_says_which_pip_command_installs_it() -> None:
    error = errors.MissingExtraError("Docker sandboxes", "sandbox", "aiodocker")
    assert str(error) == (
        "Docker sandboxes needs the 'sandbox' extra (module 'aiodocker' is not installed): "
        "pip install 'thundersync[sandbox]'"
    )


def test_unknown_id_error_is_not_quoted_like_a_key_error() -> None:
    assert str(errors.UnknownIdError("group 'g' is not open")) == "group 'g' is not open"


def test_stage_failed_gives_the_cause_first_then_the_event_without_its_tokens() -> None:
    event = ActionGenerated(group_id=1, trajectory_id=2, turn=0, token_ids=list(range(5000)))
    error = errors.StageFailed("gen", event, ValueError("boom"))
    assert error.stage == "gen" and error.event is event
    assert str(error) == (
        "stage 'gen' failed: ValueError: boom (while handling ActionGenerated(group_id=1, trajectory_id=2, "
        "turn=0, policy_version=0))"
    )


def test_a_failed_episode_in_a_stage_is_one_short_line_with_the_cause_first() -> None:
    event = ActionGenerated(group_id=1, trajectory_id=2, turn=0, token_ids=[151_000 + i for i in range(90)])
    cause = "Docker image 'agent:1' is not available (no such image): build or import it first"
    episode = errors.EpisodeError(task="'ops-1'", trajectory="trajectory 2 of group 1", tool="shell", cause=cause)
    message = str(errors.StageFailed("tool-execute", event, episode))
    assert message.startswith(f"stage 'tool-execute' failed: EpisodeError: {cause} (episode failed: task 'ops-1'")
    assert len(message) < 300 and "151000" not in message


def test_stage_failed_outside_an_event() -> None:
    assert (
        str(errors.StageFailed("src", None, RuntimeError("x")))
        == "stage 'src' failed: RuntimeError: x (outside any event)"
    )
