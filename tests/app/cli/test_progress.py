"""The progress display: step k/N, reward, tokens/s, elapsed and ETA, and the run's summary line."""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Iterator

import anyio
import pytest
import structlog

from thundersync.app.cli._terminal import Screen
from thundersync.app.cli.progress import Progress, duration, show_progress


class _Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _step(step: int, reward: float | None = 0.4125, tokens_per_s: float | None = 811.6) -> dict[str, object]:
    return {"step": step, "reward_mean": reward, "reward_std": 0.1181, "tokens_per_s": tokens_per_s}


def test_the_line_shows_step_reward_throughput_elapsed_and_eta() -> None:
    clock = _Clock()
    progress = Progress(10, clock=clock)
    clock.now = 53.5
    assert progress.line() == "step 0/10  elapsed 0:00:03"
    progress.update(_step(1))
    progress.update(_step(3))
    clock.now = 62.0  # 12 s for 3 steps: 4 s a step, 7 steps left
    assert progress.line() == "step 3/10  reward 0.412 ± 0.118  812 tok/s  elapsed 0:00:12  ETA 0:00:28"


def test_a_resumed_run_estimates_from_the_steps_it_did_itself() -> None:
    clock = _Clock()
    progress = Progress(10, clock=clock)
    progress.update(_step(7, reward=None, tokens_per_s=None))  # resumed after step 6
    progress.update(_step(8, reward=None, tokens_per_s=None))
    clock.now = 60.0  # 10 s for 2 steps, 2 left
    assert progress.line() == "step 8/10  elapsed 0:00:10  ETA 0:00:10"


def test_without_a_known_total_there_is_no_eta() -> None:
    clock = _Clock()
    progress = Progress(None, clock=clock)
    progress.update(_step(4))
    assert progress.line() == "step 4  reward 0.412 ± 0.118  812 tok/s  elapsed 0:00:00"


def test_the_summary_says_where_metrics_and_checkpoints_went() -> None:
    clock = _Clock()
    progress = Progress(5, clock=clock)
    progress.update(_step(5))
    clock.now = 3_711.0
    assert progress.summary(metrics="runs/a/m.jsonl", checkpoints="runs/a") == (
        "thundersync: 5/5 steps in 1:01:01, last reward 0.412; metrics: runs/a/m.jsonl; checkpoints: runs/a"
    )
    assert Progress(None, clock=clock).summary(metrics=None, checkpoints="c\x1b") == (
        "thundersync: 0 steps in 0:00:00; metrics: not written (no --metrics); checkpoints: c\\x1b"
    )


@pytest.mark.parametrize(("seconds", "text"), [(0.9, "0:00:00"), (61, "0:01:01"), (90_000, "25:00:00")])
def test_durations_are_hours_minutes_seconds(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_the_live_line_is_redrawn_in_place_and_ended_when_cancelled() -> None:
    clock = _Clock()
    progress, stream = Progress(2, clock=clock), io.StringIO()
    progress.display = screen = Screen(stream, progress.line, live=True, interval_s=0.0)

    async def main() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(show_progress, screen, 0.01)
            await anyio.sleep(0.05)
            progress.update(_step(1))
            await anyio.sleep(0.05)
            group.cancel_scope.cancel()

    anyio.run(main)
    text = stream.getvalue()
    assert text.startswith("\r\x1b[Kstep 0/2  elapsed 0:00:00") and text.endswith("\n") and text.count("\n") == 1
    assert (
        text.rstrip("\n").split("\r\x1b[K")[-1]
        == "step 1/2  reward 0.412 ± 0.118  812 tok/s  elapsed 0:00:00  ETA 0:00:00"
    )


def test_in_a_data_parallel_run_the_summary_names_the_rank_and_only_rank_0_lists_files() -> None:
    clock = _Clock()
    progress = Progress(5, clock=clock)
    progress.update(_step(5))
    assert progress.summary(metrics="m.jsonl", checkpoints=None, rank=("rank 0 of 2", True)) == (
        "thundersync: rank 0 of 2: 5/5 steps in 0:00:00, last reward 0.412; metrics: m.jsonl"
    )
    assert progress.summary(metrics=None, checkpoints=None, rank=("rank 1 of 2", False)) == (
        "thundersync: rank 1 of 2: 5/5 steps in 0:00:00; no files (rank 0 writes the metrics and checkpoints)"
    )


def test_a_phase_shows_its_count_rate_values_elapsed_and_eta() -> None:
    clock = _Clock()
    progress = Progress(None, clock=clock)
    progress.begin("warm-up", total=10, unit="steps")
    assert progress.line() == "warm-up 0/10 steps  elapsed 0:00:00"
    clock.now = 58.0
    progress.advance(4, loss="1.250")  # 8 s for 4 steps: 0.5 steps/s, 6 left
    assert progress.line() == "warm-up 4/10 steps  0.5 steps/s  loss 1.250  elapsed 0:00:08  ETA 0:00:12"


def test_a_phase_of_uneven_units_shows_no_rate_or_eta_and_the_innermost_phase_is_shown() -> None:
    clock = _Clock()
    progress = Progress(None, clock=clock)
    progress.begin("build", total=3, unit="objects", even=False)
    progress.advance(1, object="model")
    clock.now = 53.0
    assert progress.line() == "build 1/3 objects  object model  elapsed 0:00:03"
    progress.begin("warm-up", total=2)
    assert progress.line().startswith("warm-up 0/2 steps")
    progress.end()
    assert progress.line().startswith("build 1/3 objects")


def test_the_summary_gives_every_phase_its_time_nested_inside_its_parent() -> None:
    clock = _Clock()
    progress = Progress(4, clock=clock)
    progress.begin("build", total=2, unit="objects", even=False)
    clock.now = 51.0
    progress.begin("warm-up", total=450)
    clock.now = 141.0
    progress.end()  # warm-up: 90 s
    clock.now = 142.0
    progress.end()  # build: 92 s
    with progress.steps_phase():
        progress.update(_step(4))
        clock.now = 172.0  # steps: 30 s
    assert progress.summary(metrics="m.jsonl", checkpoints=None) == (
        "thundersync: 4/4 steps in 0:00:30 (build 0:01:32 (warm-up 0:01:30), steps 0:00:30; total 0:02:02), "
        "last reward 0.412; metrics: m.jsonl"
    )


def test_a_step_whose_groups_all_lack_signal_says_so_on_the_line() -> None:
    progress = Progress(4, clock=_Clock())
    progress.update(_step(1) | {"groups_rewarded": 8, "groups_without_signal": 3})
    assert "no signal" not in progress.line()
    progress.update(_step(2) | {"groups_rewarded": 8, "groups_without_signal": 8})
    assert progress.line().startswith("step 2/4  reward 0.412 ± 0.118 (no signal: every group's rewards equal)  812")


def test_without_a_live_line_a_phase_writes_the_lines_it_asks_for() -> None:
    clock = _Clock()
    progress, stream = Progress(None, clock=clock), io.StringIO()
    progress.display = Screen(stream, progress.line, live=False)
    progress.begin("warm-up", total=4, record=True)
    progress.advance(1)
    clock.now = 54.0
    progress.advance(2, line=True, loss="0.500")
    clock.now = 58.0
    progress.advance(4)
    progress.end()
    assert stream.getvalue() == (
        "thundersync: warm-up 0/4 steps  elapsed 0:00:00\n"  # it started: a line from its first second
        "thundersync: warm-up 2/4 steps  0.5 steps/s  loss 0.500  elapsed 0:00:04  ETA 0:00:04\n"
        "thundersync: warm-up 4/4 steps in 0:00:08  0.5 steps/s  loss 0.500\n"
    )


@pytest.fixture
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("_restore_logging")
def test_warnings_and_logs_are_one_line_each_above_the_live_line() -> None:
    progress, stream = Progress(None, clock=_Clock()), io.StringIO()
    progress.display = screen = Screen(stream, progress.line, live=True, interval_s=0.0)
    with warnings.catch_warnings(), screen.routing(verbose=False):
        warnings.simplefilter("always")
        progress.begin("warm-up", total=4)
        for _ in range(3):  # each sandbox warns, the same words: shown once
            warnings.warn("the local backend is not\x1b an isolation boundary", UserWarning, stacklevel=1)
        logging.getLogger("thundersync.test").warning("a library warning")
        structlog.get_logger("thundersync.cli").warning("a command warning")
    text = stream.getvalue()
    line = "warm-up 0/4 steps  elapsed 0:00:00"
    said = text.split("\r\x1b[K")
    assert said[:3] == [
        "",
        line,
        "thundersync: warning: UserWarning: the local backend is not\\x1b an isolation boundary\n" + line,
    ]
    assert said[3].endswith("a library warning\n" + line) and "[WARNING] thundersync.test" in said[3]
    assert said[4].endswith("\n" + line) and "a command warning" in said[4]
    assert said[5] == line + "\n"  # the routing's end leaves the live line's last state
    assert "warnings.warn(" not in text and __file__ not in text  # no echo of the source line
    assert warnings.showwarning is not screen.warning
