"""The library logs quietly: nothing is printed unless the application configures logging."""

from __future__ import annotations

import logging

import pytest

from thundersync._logging import get_logger


@pytest.fixture
def unconfigured_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The standard logging module as a fresh process has it (other tests may configure it)."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", logging.WARNING)


@pytest.mark.usefixtures("unconfigured_logging")
def test_library_info_logs_print_nothing_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    get_logger("thundersync.test").info("kernel probed", kernel="x", ok=True)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_library_logs_reach_the_standard_logging_module(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="thundersync.test"):
        get_logger("thundersync.test").info("kernel probed", kernel="x", ok=True)
    assert [r.name for r in caplog.records] == ["thundersync.test"]
    assert caplog.records[0].getMessage() == "event='kernel probed' kernel='x' ok=True"
