"""The progress display: step k/N, reward, tokens/s, elapsed and ETA, and the run's summary line."""

from __future__ import annotations

import io

import anyio
import pytest

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

    async def main() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(show_progress, progress, stream, 0.01)
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
