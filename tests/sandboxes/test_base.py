"""Limits are validated with messages that name the field; results report truncation."""

from __future__ import annotations

import msgspec
import pytest

from thundersync.errors import ConfigError
from thundersync.sandboxes import ExecResult, SandboxLimits


def test_limits_reject_non_positive_values_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="SandboxLimits.pids must be > 0, got 0"):
        SandboxLimits(pids=0)
    with pytest.raises(ConfigError, match="SandboxLimits.cpus and timeout_s must be > 0, got 1.0, -1"):
        SandboxLimits(timeout_s=-1)


def test_the_hard_cap_must_leave_room_for_both_kept_streams() -> None:
    with pytest.raises(ConfigError, match="output_cap_bytes \\(100\\) must be at least twice output_bytes \\(64\\)"):
        SandboxLimits(output_bytes=64, output_cap_bytes=100)


def test_limits_decode_from_toml_like_data_and_refuse_unknown_fields() -> None:
    assert msgspec.convert({"pids": 32}, SandboxLimits).pids == 32
    with pytest.raises(msgspec.ValidationError, match="Object contains unknown field `pid`"):
        msgspec.convert({"pid": 32}, SandboxLimits)


def test_exec_result_is_truncated_when_any_stream_elided_bytes() -> None:
    assert not ExecResult(0, "", "").truncated
    assert ExecResult(0, "", "", stderr_elided=1).truncated
    assert ExecResult(0, "", "").ok and not ExecResult(1, "", "").ok and not ExecResult(None, "", "").ok
