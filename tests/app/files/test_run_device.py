"""`[run] device`: the device of every object that takes one and gives none; an object's own wins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.app.specs import SOURCE
from thundersync._device import resolve_device
from thundersync.app.cli.command import main
from thundersync.app.files.build import build_objects
from thundersync.app.files.check import check_run_settings
from thundersync.app.files.definition import RunSettings, loads
from thundersync.errors import ConfigError, DefinitionError

TINY = Path(__file__).resolve().parents[3] / "examples" / "train_tiny_grpo.toml"

MODEL = (
    SOURCE
    + """\
[objects.model]
factory = "model"
config = { vocab_size = 64, hidden_size = 16, intermediate_size = 32, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 8 }
"""
)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def test_run_device_defaults_to_auto_which_is_the_cpu_without_a_gpu(no_cuda: None) -> None:
    spec = loads(MODEL)
    assert spec.run.device == "auto" and RunSettings().device == "auto"
    assert "device" not in spec.objects["model"].args
    assert _device_of(build_objects(spec)["model"]) == torch.device("cpu")


def test_auto_is_the_current_gpu_when_torch_sees_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_run_device_reaches_an_object_that_gives_no_device(no_cuda: None) -> None:
    spec = loads(MODEL, ["run.device=cuda"])
    with pytest.raises(DefinitionError, match=r"run\.device: device 'cuda', but torch sees no CUDA device"):
        build_objects(spec)
    assert _device_of(build_objects(loads(MODEL, ["run.device=cpu"]))["model"]) == torch.device("cpu")


def test_an_object_that_gives_its_own_device_keeps_it(no_cuda: None) -> None:
    spec = loads(MODEL + 'device = "cpu"\n', ["run.device=cuda"])  # cuda is not there: never asked for
    assert _device_of(build_objects(spec)["model"]) == torch.device("cpu")
    with pytest.raises(DefinitionError, match=r"objects\.model: model failed: device 'cuda:1', but torch sees no"):
        build_objects(loads(MODEL + 'device = "cuda:1"\n', ["run.device=cpu"]))


def test_a_gpu_index_past_the_last_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(
        ConfigError, match=r"device 'cuda:2', but torch sees 2 CUDA device\(s\) here \(cuda:0 to cuda:1\)"
    ):
        resolve_device("cuda:2")


@pytest.mark.parametrize("value", ["GPU", "CUDA", "cuda:", "cuda:x", "cpu:0", "", "7"])
def test_a_bad_run_device_fails_at_load_naming_it_and_the_accepted_forms(value: str) -> None:
    with pytest.raises(
        DefinitionError, match=rf"^run\.device: unknown device '{value}'; give \"cpu\", \"cuda\", \"cuda:N\""
    ):
        loads(MODEL, [f'run.device="{value}"'])


def test_a_bad_object_device_fails_at_load_naming_the_object() -> None:
    with pytest.raises(DefinitionError, match=r"^objects\.model\.device: unknown device 'gpu'; give \"cpu\""):
        loads(MODEL + 'device = "gpu"\n')
    assert loads(MODEL + 'device = "cuda:3"\n').objects["model"].args["device"] == "cuda:3"  # checked at run


def test_check_refuses_a_bad_run_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(TINY), "--set", "run.device=cpu"]) == 0
    assert main(["check", str(TINY), "--set", "run.device=gpu"]) == 2
    assert "train_tiny_grpo.toml: run.device: unknown device 'gpu'" in capsys.readouterr().err


def test_data_parallel_refuses_a_run_device_with_a_gpu_index() -> None:
    check_run_settings(loads(MODEL, ["run.device=cuda"]), data_parallel=True)
    check_run_settings(loads(MODEL, ["run.device=cuda:1"]))
    with pytest.raises(
        DefinitionError, match=r"run\.device: 'cuda:1' would put every rank .* give \"cuda\" or \"auto\""
    ):
        check_run_settings(loads(MODEL, ["run.device=cuda:1"]), data_parallel=True)


@pytest.mark.gpu
def test_run_device_cuda_puts_the_model_on_the_gpu_unless_it_gives_its_own() -> None:
    assert _device_of(build_objects(loads(MODEL, ["run.device=cuda"]))["model"]).type == "cuda"
    assert _device_of(build_objects(loads(MODEL))["model"]).type == "cuda"  # auto
    own = build_objects(loads(MODEL + 'device = "cpu"\n', ["run.device=cuda"]))["model"]
    assert _device_of(own) == torch.device("cpu")
