"""The ``transformers-teacher`` factory of pipeline files: a model directory, or a training run's
checkpoint directory, whose run's newest checkpoint of full weights is the teacher."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.tiny_models import tiny_qwen3
from thundersync.app.checkpoints.checkpoint import Checkpointer
from thundersync.app.factories.registry import ALL_FACTORIES
from thundersync.errors import ConfigError
from thundersync.pipeline.policy import PolicyClock
from thundersync.tasks.model_teacher import transformers_teacher


def test_the_teacher_factory_takes_a_runs_checkpoint_directory_and_loads_its_runs_newest_checkpoint(
    tmp_path: Path,
) -> None:
    model = tiny_qwen3(seed=0)
    saver = Checkpointer(
        tmp_path / "run", model=model, optimizer=torch.optim.SGD(model.parameters()), policy=PolicyClock()
    )
    saver.save(2)
    saver.save(10)
    (tmp_path / "run" / "step-00000012").mkdir()  # incomplete: no checkpoint.json
    teacher = ALL_FACTORIES["transformers-teacher"](path=str(tmp_path / "run"))
    assert teacher._model is None  # nothing loaded yet
    assert teacher.model.name_or_path == str(tmp_path / "run" / "step-00000010")
    with pytest.raises(
        ConfigError,
        match=r"the teacher path '.*empty' is not a model directory \(no config\.json\) and holds no checkpoint "
        r"of full weights of its run .*train the teacher first \(thundersync run examples/agent_grpo\.toml",
    ):
        ALL_FACTORIES["transformers-teacher"](path=str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"the teacher path '.*run' is not a model directory \(no config\.json\); "):
        transformers_teacher(path=str(tmp_path / "run"))  # the library's own takes a model directory alone
