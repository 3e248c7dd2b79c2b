"""User strings reach the terminal escaped: control and format characters the way repr writes them."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from thundersync.app.cli._terminal import configure_logging, printable


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("reward", "reward"),
        ("gén 2 ✓", "gén 2 ✓"),
        ("src\x1b[31m", "src\\x1b[31m"),
        ("a\nb\tc\r", "a\\nb\\tc\\r"),
        ("\u202eevil", "\\u202eevil"),
        ("bell\x07", "bell\\x07"),
    ],
)
def test_printable_escapes_what_a_terminal_would_act_on(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_log_lines_escape_user_strings(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(verbose=True)
    structlog.get_logger("t").info("run\x1b[2J started", file="a\nb.toml")
    logging.getLogger("thundersync.t").warning("stage %s failed", "x\x1b]0;title\x07")
    err = capsys.readouterr().err
    assert "run\\x1b[2J started" in err and "file=a\\nb.toml" in err
    assert "stage x\\x1b]0;title\\x07 failed" in err
    assert "\x1b" not in err and "\x07" not in err
