"""``thundersync check`` validates the options a file passes on to torch.optim and vLLM, building nothing."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from thundersync.app.files.check import check_pipeline
from thundersync.app.files.definition import loads
from thundersync.errors import DefinitionError

TINY = (Path(__file__).resolve().parents[3] / "examples" / "train_tiny_grpo.toml").read_text()
VLLM = """\
[objects.generator]
factory = "vllm-generator"
model = "models/not-loaded-by-check"
gpu_memory_utilization = 0.3
{extra}
[stages.source]
type = "source"
prompts = [[1]]
"""


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            'objects.optimizer.name="Adamw"',
            r"objects.optimizer.name: unknown torch.optim optimizer 'Adamw'; valid: .*AdamW",
        ),
        (
            "objects.optimizer.betas2=0.9",
            r"objects.optimizer.betas2: AdamW takes no option\(s\) betas2; its options: lr, betas",
        ),
        ("objects.optimizer.maximize=false", r"objects.optimizer.maximize: maximize = False would train the reward"),
        ('objects.optimizer.name="LBFGS"', r"objects.optimizer.name: LBFGS cannot maximize \(no maximize option\)"),
    ],
)
def test_check_refuses_optimizer_options_torch_would_refuse(override: str, message: str) -> None:
    with pytest.raises(DefinitionError, match=f"^{message}"):
        check_pipeline(loads(TINY, [override]))


def test_check_accepts_shard_state_and_refuses_a_non_bool() -> None:
    check_pipeline(loads(TINY, ["objects.optimizer.shard_state=true"]))
    with pytest.raises(DefinitionError, match=r"^objects.optimizer.shard_state: Expected `bool`, got `int`"):
        check_pipeline(loads(TINY, ["objects.optimizer.shard_state=1"]))


def test_check_accepts_any_torch_optim_class_with_its_own_options() -> None:
    check_pipeline(loads(TINY, ['objects.optimizer.name="SGD"', "objects.optimizer.momentum=0.9"]))


def test_check_refuses_a_schedule_no_trainer_steps() -> None:
    unstepped = TINY.replace('schedule = { object = "schedule" }\nmax_grad_norm', "max_grad_norm")
    with pytest.raises(DefinitionError, match="^objects.schedule: no streaming-trainer steps this lr-schedule"):
        check_pipeline(loads(unstepped))


def test_check_refuses_a_schedule_of_another_optimizer_than_its_trainers() -> None:
    other = TINY + '[objects.other]\nfactory = "optimizer"\nobjective = { object = "objective" }\nname = "SGD"\n'
    other = other.replace("warmup_steps = 1", 'warmup_steps = 1\noptimizer = { object = "other" }', 1)
    other = other.replace(
        '[objects.schedule]\nfactory = "lr-schedule"\noptimizer = { object = "optimizer" }\n',
        '[objects.schedule]\nfactory = "lr-schedule"\n',
    )
    with pytest.raises(
        DefinitionError,
        match="^objects.trainer.schedule: the schedule 'schedule' drives the optimizer 'other', but this trainer steps 'optimizer'",
    ):
        check_pipeline(loads(other))


@pytest.mark.slow  # imports vLLM (seconds)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")
def test_check_refuses_engine_options_vllm_does_not_have_and_suggests_the_spelling() -> None:
    pytest.importorskip("vllm")
    check_pipeline(loads(VLLM.format(extra="max_model_len = 128")))
    with pytest.raises(
        DefinitionError,
        match=r"^objects.generator.gpu_memory_utilisation: not an option of vLLM's engine .*did you mean gpu_memory_utilization",
    ):
        check_pipeline(loads(VLLM.format(extra="gpu_memory_utilisation = 0.3")))


def test_without_vllm_check_skips_its_engine_options_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError, as where it is not installed
    with caplog.at_level(logging.WARNING, logger="thundersync.app.files.check"):
        check_pipeline(loads(VLLM.format(extra="no_such_option = 1")))
    (record,) = caplog.records
    assert "event='vllm_options_not_checked'" in record.message and "object='objects.generator'" in record.message
    assert "vLLM is not importable here" in record.message
