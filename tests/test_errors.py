"""The exception hierarchy: builtin bases for bad input, readable messages."""

from __future__ import annotations

import pytest

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


def test_stage_failed_names_the_stage_and_event_with_a_bounded_message() -> None:
    event = ActionGenerated(group_id=1, trajectory_id=2, turn=0, token_ids=list(range(5000)))
    error = errors.StageFailed("gen", event, ValueError("boom"))
    assert error.stage == "gen" and error.event is event
    assert len(str(error)) < 500
    with pytest.raises(
        errors.StageFailed,
        match=r"^stage 'gen' failed while handling ActionGenerated\(group_id=1.*"
        r"characters elided.*: ValueError: boom$",
    ):
        raise error


def test_stage_failed_outside_an_event() -> None:
    assert (
        str(errors.StageFailed("src", None, RuntimeError("x")))
        == "stage 'src' failed outside any event: RuntimeError: x"
    )
