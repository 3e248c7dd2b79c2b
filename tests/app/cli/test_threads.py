"""torch's CPU threads in a run: ``[run] threads``, or one core fewer than the process may use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

from thundersync.app.cli.command import main
from thundersync.app.cli.threads import default_threads, use_threads

SMALL = """\
[objects.generator]
factory = "test-scripted-generator"
[objects.scorer]
factory = "test-fake-scorer"
[objects.policy]
factory = "policy-clock"
[stages.source]
type = "source"
prompts = [[1, 2], [3]]
samples = 2
[stages.generate]
type = "generate"
reads = ["source"]
[stages.reward]
type = "reward"
reads = ["generate"]
[stages.close]
type = "close"
reads = ["generate", "reward"]
output = true
[stages.step]
type = "step"
reads = ["close"]
output = true
"""


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.mark.parametrize(
    ("cores", "torch_default", "threads"), [(1, 1, 1), (2, 2, 1), (4, 4, 3), (16, 8, 8), (64, 32, 32)]
)
def test_the_default_leaves_a_core_to_the_rest_of_the_run_and_keeps_to_torchs_own(
    cores: int, torch_default: int, threads: int
) -> None:
    assert default_threads(cores, torch_default, omp="") == threads


def test_a_thread_count_from_omp_num_threads_is_the_default() -> None:
    assert default_threads(16, 1, omp="1") == 1  # torchrun's, for several processes per node
    assert default_threads(2, 2, omp="2") == 2


def test_threads_are_set_for_the_block_and_restored_after_it() -> None:
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with use_threads(other) as chosen:
        assert chosen == other == torch.get_num_threads()
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("setting", [[], ["--set", "run.threads=3"]])
def test_a_run_uses_the_files_threads_or_the_default(
    setting: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    before = torch.get_num_threads()
    assert main(["run", str(path), "--verbose", *setting]) == 0
    expected = 3 if setting else default_threads()  # the environment's OMP_NUM_THREADS, if any, included
    assert f"threads={expected}" in capsys.readouterr().err
    assert torch.get_num_threads() == before
