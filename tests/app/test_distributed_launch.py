"""What `thundersync run` reads from a data-parallel launcher's environment (no process group here)."""

from __future__ import annotations

import pytest

from thundersync.app.distributed import TIMEOUT_ENV, launch, rank_label
from thundersync.errors import ConfigError


def test_without_a_launcher_there_is_no_rank_and_no_process_group() -> None:
    assert rank_label({}) == "" and rank_label({"WORLD_SIZE": "1", "RANK": "0"}) == ""
    with launch({"WORLD_SIZE": "1"}) as ranks:
        assert ranks is None


def test_error_lines_of_a_launched_rank_name_it() -> None:
    assert rank_label({"WORLD_SIZE": "4", "RANK": "3"}) == "rank 3 of 4: "


@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan"])
def test_a_timeout_that_is_not_positive_seconds_is_refused_before_joining(value: str) -> None:
    message = f"{TIMEOUT_ENV}='{value}': give the seconds a collective may wait"
    with pytest.raises(ConfigError, match=message), launch({"WORLD_SIZE": "2", "RANK": "0", TIMEOUT_ENV: value}):
        pass


def test_a_malformed_rank_variable_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"RANK='x' is not an integer; the launcher \(torchrun\) sets it"):
        rank_label({"WORLD_SIZE": "2", "RANK": "x"})
