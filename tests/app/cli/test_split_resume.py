"""``--resume`` of a ``[run.split]`` file, in this process: a rollout rank continues after the
step the learner's first broadcast carries, a resumed learner whose data position the rollout
ranks cannot take is refused, and a learner refuses groups of another batch than the one it steps.

The whole resume under torchrun (the learner restoring its checkpoint, the roles swapped, the
result equal to the uninterrupted one-process run) is in tests/app/cli/test_split_file_run.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from thundersync.app.cli.command import _rollout_rank
from thundersync.app.cli.distributed import Launch
from thundersync.app.cli.split import SplitParts, _generate, split_parts
from thundersync.app.cli.split_learner import _check_position, _Seen
from thundersync.app.files.build import build_graph, build_objects
from thundersync.app.files.definition import loads
from thundersync.app.metrics.step_metrics import StepMetrics
from thundersync.errors import ConfigError, PipelineError

ROOT = Path(__file__).resolve().parents[3]
TINY = (ROOT / "examples" / "train_tiny_grpo.toml").read_text()
SPLIT = TINY + "\n[run.split]\nrollout = [1]\nlearner = [0]\n"


def _parts(*sets: str) -> SplitParts:
    spec = loads(SPLIT, ['objects.checkpointer.directory="unused"', *sets])
    return split_parts(build_graph(spec, **build_objects(spec)))


class _Channel:
    """The rollout side of a channel whose learner broadcasts ``versions`` in turn."""

    def __init__(self, versions: list[int]) -> None:
        self.versions = versions

    def receive_weights(self, params: Any) -> int:
        return self.versions.pop(0)


def test_a_rollout_rank_continues_after_the_step_the_learner_broadcasts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner resumed at step 2 of 4 broadcasts version 2 first: the rollout rank generates
    batches 2 and 3 (groups 4..7, the uninterrupted run's), on version 2 then 3, and reads no
    checkpoint (``_rollout_rank``: the command skips its ``--resume``)."""
    import thundersync.split

    generated: list[tuple[list[int], int]] = []

    async def generate_batch(channel: Any, sampler: Any, prompts: Any, *, version: int, **_: Any) -> int:
        generated.append(([group for group, _ in prompts], version))
        return 0

    monkeypatch.setattr(thundersync.split, "generate_batch", generate_batch)
    parts = _parts("run.steps=4")
    done = anyio.run(_generate, _Channel([2, 3, 4, 5, 6]), parts)
    assert generated == [([4, 5], 2), ([6, 7], 3)] and done == 2
    spec = loads(SPLIT)
    ranks = [Launch(rank=r, world_size=2, local_rank=r, timeout_s=60.0, store=object()) for r in (0, 1)]
    assert [_rollout_rank(spec, launched) for launched in ranks] == [False, True]
    assert [_rollout_rank(loads(TINY), launched) for launched in ranks] == [False, False]  # data parallel: every rank


def test_a_resumed_learner_whose_consumed_batches_are_not_the_first_ones_is_refused() -> None:
    """The rollout ranks skip the source's first ``step`` batches; a learner whose checkpoint
    consumed others (not written by a split or a run of this source) is refused before it broadcasts."""
    source = _parts().source
    _check_position(source, 0)  # a run from the start
    source.skip_batches([0, 1])
    _check_position(source, 2)  # a resume: what every run of this file consumes
    source.skip_batches([0, 2])
    with pytest.raises(
        ConfigError,
        match=r"^run\.split: the learner resumed at step 2 with the source's batches \[0, 2\] \(2 batches\) consumed, "
        r"not its first 2, 0\.\.1; the rollout ranks continue after the source's first 2 batches, so they would "
        r"sample other batches than the learner steps on: resume this checkpoint without \[run\.split\]$",
    ):
        _check_position(source, 2)


def test_the_learner_refuses_a_group_of_another_batch() -> None:
    """Batch 1 holds groups 2 and 3: group 0 (batch 0's) or group 2 with another prompt is refused
    before the objective sees it; group 2 with its prompt goes to the objective."""
    parts = _parts()
    batch = list(parts.source.batches())[1]
    opened: list[int] = []
    seen = _Seen(parts.objective, StepMetrics(), batch, 1)
    seen.objective = type("Objective", (), {"open_group": lambda self, group, prompt: opened.append(group)})()  # type: ignore[assignment]
    for group, prompt in ((0, list(batch[0].prompt_tokens)), (2, [1, 2])):
        with pytest.raises(PipelineError, match=rf"^run\.split: the learner received group {group} \(prompt of \d+ "):
            seen.open_group(group, prompt)
    assert opened == []
    seen.open_group(2, list(batch[0].prompt_tokens))
    assert opened == [2] and [int(p.group_id) for p in batch] == [2, 3]
