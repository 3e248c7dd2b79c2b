"""What a run needs from the machine fails before anything is built, and ``check`` says the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from thundersync.app.cli.command import main
from thundersync.app.files import preflight
from thundersync.testing import FakeScorer, ScriptedGenerator

SMALL = """\
[run]
metrics = "{metrics}"
{run}
[objects.generator]
factory = "test-scripted-generator"
[objects.scorer]
factory = "test-fake-scorer"
{objects}
[stages.source]
type = "source"
prompts = [[1, 2], [3]]
groups_per_batch = 1
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
"""

DOCKER_TOOLS = """\
[objects.tools]
factory = "sandbox-tools"
backend = "{backend}"
image = "thundersync-test/never-built:1"
tools = ["shell"]
"""


@pytest.fixture(autouse=True)
def _nothing_is_built(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any object built before the checks failed fails the test instead of the run."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an object was built before the checks that need none")

    for cls in (ScriptedGenerator, FakeScorer):
        monkeypatch.setattr(cls, "__init__", refuse)
    yield
    structlog.reset_defaults()


def _file(tmp_path: Path, *, run: str = "", objects: str = "", metrics: Path | None = None) -> Path:
    path = tmp_path / "small.toml"
    metrics = metrics or tmp_path / "m.jsonl"
    path.write_text(SMALL.format(metrics=metrics, run=run, objects=objects))
    return path


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], message: str, status: int = 2) -> None:
    assert main(argv) == status
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1


def test_an_existing_metrics_file_fails_run_and_check_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _file(tmp_path)
    (tmp_path / "m.jsonl").write_text("{}\n")
    message = f"the metrics file {tmp_path / 'm.jsonl'} already exists and is never overwritten silently"
    _fails(["run", str(path)], capsys, message)
    _fails(["check", str(path)], capsys, message)
    assert (tmp_path / "m.jsonl").read_text() == "{}\n"


def test_a_metrics_file_in_a_missing_directory_fails_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _file(tmp_path, metrics=tmp_path / "nowhere" / "m.jsonl")
    _fails(["check", str(path)], capsys, f"its directory {tmp_path / 'nowhere'} does not exist; create it first")
    assert not (tmp_path / "nowhere").exists()


def test_a_tensorboard_directory_of_an_earlier_run_fails_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    board = tmp_path / "tb"
    board.mkdir()
    (board / "events.out.tfevents.1.host").write_bytes(b"")
    path = _file(tmp_path, run=f'tensorboard = "{board}"')
    _fails(["run", str(path)], capsys, f"the TensorBoard directory {board} already holds 1 event file(s)")
    _fails(["check", str(path)], capsys, f"the TensorBoard directory {board} already holds 1 event file(s)")
    assert (board / "events.out.tfevents.1.host").exists()


def test_a_docker_backend_without_a_daemon_fails_check_and_run_and_check_offline_skips_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-daemon.sock'}")
    path = _file(tmp_path, objects=DOCKER_TOOLS.format(backend="docker"))
    message = f"{path}: objects.tools.backend: docker, but the Docker daemon does not answer: "
    _fails(["check", str(path)], capsys, message)
    _fails(["run", str(path)], capsys, message)
    assert main(["check", "--offline", str(path)]) == 0


def test_a_udocker_backend_without_its_binary_or_image_fails_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _file(tmp_path, objects=DOCKER_TOOLS.format(backend="udocker"))
    monkeypatch.setenv("THUNDERSYNC_UDOCKER_BIN", str(tmp_path / "no-udocker"))
    _fails(["check", "--offline", str(path)], capsys, "objects.tools.backend: udocker, but uDocker is not installed")
    monkeypatch.setenv("THUNDERSYNC_UDOCKER_BIN", "true")  # a binary: the image is what is missing
    monkeypatch.setenv("UDOCKER_DIR", str(tmp_path / "udocker"))
    _fails(
        ["check", "--offline", str(path)],
        capsys,
        "objects.tools.image: uDocker has no image 'thundersync-test/never-built:1'",
    )


def test_a_teacher_path_without_a_model_fails_check_and_run_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    teacher = f'[objects.teacher]\nfactory = "transformers-teacher"\npath = "{tmp_path / "runs" / "none"}"\n'
    path = _file(tmp_path, objects=teacher)
    message = f"{path}: objects.teacher.path: the teacher path '{tmp_path / 'runs' / 'none'}' is not a model directory"
    _fails(["check", str(path)], capsys, message)
    _fails(["run", str(path)], capsys, message)


def test_a_cuda_device_this_machine_lacks_fails_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    count = torch.cuda.device_count()
    path = _file(tmp_path, run=f'device = "cuda:{count}"')
    seen = "sees no CUDA device" if count == 0 else f"sees {count} CUDA device(s) here"
    _fails(["check", str(path)], capsys, f"{path}: run.device: device 'cuda:{count}', but torch {seen}")


def test_a_learner_partition_this_machine_cannot_make_fails_check_and_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _file(tmp_path)
    path.write_text(path.read_text() + "[acceleration]\nlearner_sms = 64\n")
    monkeypatch.setattr("thundersync._green.missing", lambda device: "torch sees no CUDA device")
    message = "acceleration.learner_sms: 64 puts the learner on a CUDA green context, but torch sees no CUDA device"
    _fails(["check", str(path)], capsys, f"{path}: {message}")
    _fails(["run", str(path)], capsys, message)
    monkeypatch.setattr("thundersync._green.missing", lambda device: None)  # a machine that has them
    assert main(["check", str(path)]) == 0


def test_a_factory_whose_extra_is_missing_fails_check_naming_the_pip_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # every extra is installed here: stand a module that is not for the one the sandbox needs
    monkeypatch.setitem(preflight.EXTRAS, "test-fake-scorer", (("data", "thundersync_no_such_module"),))
    path = _file(tmp_path)
    _fails(
        ["check", str(path)],
        capsys,
        "objects.scorer (factory 'test-fake-scorer') needs the 'data' extra (module 'thundersync_no_such_module' "
        "is not installed): pip install 'thundersync[data]'",
        status=1,  # as for every missing extra
    )


def test_check_refuses_a_prompt_token_id_the_events_could_not_carry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _file(tmp_path)
    _fails(
        ["check", str(path), "--set", "stages.source.prompts=[[1, 2147483648]]"],
        capsys,
        "stages.source.prompts[0][1]: Expected `int` <= 2147483647",
    )
    _fails(
        ["check", str(path), "--set", "stages.generate.stop_token_ids=[4294967296]"],
        capsys,
        "stages.generate.stop_token_ids[0]: Expected `int` <= 2147483647",
    )


def test_check_refuses_an_object_of_the_wrong_kind_for_a_stage_as_run_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    teacher = '[objects.teacher]\nfactory = "test-fake-teacher"\n'
    path = _file(tmp_path, objects=teacher)
    message = (
        "stages.reward.objects.scorer: references 'teacher', a 'test-fake-teacher' object that makes a "
        "FakeTeacher, but this field takes a Scorer or a TaskScorer or a TrajectoryScorer"
    )
    _fails(["check", str(path), "--set", 'stages.reward.objects={ scorer = "teacher" }'], capsys, message)
