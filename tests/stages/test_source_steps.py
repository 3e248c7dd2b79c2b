"""A source limited to N batches (a file's ``[run] steps``) repeats its tasks as long as needed."""

from __future__ import annotations

import pytest

from thundersync.errors import ConfigError
from thundersync.stages.source import SourceStage

PROMPTS = [[1], [2], [3]]


def _source(groups_per_batch: int = 0, repeat: int = 1, shuffle_seed: int | None = None) -> SourceStage:
    config = SourceStage.Config(
        prompts=PROMPTS, groups_per_batch=groups_per_batch, repeat=repeat, shuffle_seed=shuffle_seed
    )
    return SourceStage(config)


def test_a_batch_limit_runs_more_epochs_than_repeat_says() -> None:
    stage = _source(groups_per_batch=2, repeat=1)
    stage.limit_batches(4)
    out = stage.submissions()
    assert stage.num_batches == 4
    assert [e.prompt_tokens[0] for e in out] == [1, 2, 3, 1, 2, 3, 1, 2]  # 4 full batches of 2: epochs 1-3
    assert [e.batch_id for e in out] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(e.groups_in_batch == 2 for e in out)


def test_a_batch_limit_below_repeat_stops_early_and_keeps_the_shuffled_order() -> None:
    unlimited = _source(groups_per_batch=2, repeat=5, shuffle_seed=3)
    limited = _source(groups_per_batch=2, repeat=5, shuffle_seed=3)
    limited.limit_batches(2)
    assert limited.submissions() == unlimited.submissions()[:4]
    assert (limited.num_batches, unlimited.num_batches) == (2, 8)


def test_without_groups_per_batch_each_limited_batch_is_repeat_epochs() -> None:
    stage = _source(repeat=2)
    stage.limit_batches(2)
    assert [e.batch_id for e in stage.submissions()] == [0] * 6 + [1] * 6


def test_a_batch_limit_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="at least one batch, got a limit of 0"):
        _source().limit_batches(0)
