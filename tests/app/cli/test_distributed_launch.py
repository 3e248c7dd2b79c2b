"""What `thundersync run` reads from a data-parallel launcher's environment (no process group here)."""

from __future__ import annotations

import pytest

from thundersync.app.cli.distributed import TIMEOUT_ENV, Launch, balance, launch, rank_label
from thundersync.errors import ConfigError
from thundersync.pipeline.graph import Graph
from thundersync.scheduling import Admission, GroupClaims, RankClaims
from thundersync.stages.source import SourceStage


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


def _source(groups_per_batch: int, admission: Admission, *, claimed: bool = True) -> SourceStage:
    claims = RankClaims(GroupClaims(object(), rank=0, world_size=3)) if claimed else None
    config = SourceStage.Config(prompts=[[1], [2], [3], [4], [5]], groups_per_batch=groups_per_batch)
    return SourceStage(config, admission=admission, claims=claims)


def test_balance_bounds_a_claiming_source_without_max_groups_to_its_share_of_a_batch() -> None:
    ranks = Launch(rank=0, world_size=3, local_rank=0, timeout_s=60.0, store=object())
    free, tokens, set_, alone = Admission(), Admission(max_tokens=100), Admission(max_groups=1), Admission()
    graph = Graph()
    graph.add("a", _source(5, free)).add("b", _source(0, tokens)).add("c", _source(7, set_))
    graph.add("d", _source(5, alone, claimed=False))
    balance(ranks, graph)
    assert free.config.max_groups == 2  # ceil(5 / 3)
    assert (tokens.config.max_groups, tokens.config.max_tokens) == (2, 100)  # 0: the 5 groups in one batch
    assert set_.config.max_groups == 1 and alone.config.max_groups is None  # given; not data-parallel
