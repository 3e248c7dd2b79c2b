"""`thundersync check` and `thundersync run` on pipeline files: exit codes, messages, metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from thundersync.app.cli.command import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "pipeline_fake.toml"
SMALL = """\
# thundersync run small.toml
[objects.generator]
factory = "test-scripted-generator"
{generator}
[objects.scorer]
factory = "test-fake-scorer"
[objects.policy]
factory = "policy-clock"
[stages.source]
type = "source"
prompts = [[1, 2], [3], [4, 5, 6]]
samples = 2
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
[stages.step]
type = "step"
reads = ["close"]
output = true
{extra}"""


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # main() configures logging for the process, as a CLI does


def _small(tmp_path: Path, generator: str = "", extra: str = "") -> Path:
    path = tmp_path / "small.toml"
    path.write_text(SMALL.format(generator=generator, extra=extra))
    return path


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_check_validates_the_example_and_lists_its_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{EXAMPLE}: ok, 7 stages, 5 runtime objects\n")
    assert "  close: type close, reads generate, reward, teacher\n" in out


def test_run_writes_one_metrics_line_per_lifecycle_event_and_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert main(["run", str(EXAMPLE), "--metrics", str(metrics)]) == 0
    records = _records(metrics)
    kinds = Counter(record["event"] for record in records)
    assert records[0]["event"] == "run_started" and records[0]["stages"] == [
        "source",
        "generate",
        "tool-execute",
        "reward",
        "teacher",
        "close",
        "step",
    ]
    assert records[-1]["event"] == "run_finished" and records[-1]["status"] == "ok"
    # 4 prompts x 25 repeats = 100 groups of 4 samples, 2 groups per batch
    assert kinds["GroupClosed"] == 100 and kinds["TrajectoryClosed"] == 400
    assert kinds["BatchReady"] == kinds["StepDone"] == kinds["PolicyPublished"] == kinds["step"] == 50
    assert kinds["stage_statistics"] == 8  # the seven stages and the step-metrics watcher
    versions = [r["policy_version"] for r in records if r["event"] == "StepDone"]
    assert versions == list(range(1, 51)) == [r["step"] for r in records if r["event"] == "step"]
    err = capsys.readouterr().err  # not a terminal: no progress line, logs are quiet, one summary line
    assert re.fullmatch(
        rf"thundersync: 50/50 steps in 0:00:\d\d \(build 0:00:\d\d, steps 0:00:\d\d; total 0:00:\d\d\), "
        rf"last reward \d\.\d{{3}}; metrics: {metrics}\n",
        err,
    )


def test_run_shows_progress_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(_small(tmp_path)), "--progress"]) == 0
    *_, live, summary = capsys.readouterr().err.rstrip("\n").split("\n")
    last = live.split("\r\x1b[K")[-1]
    assert re.fullmatch(r"step 3/3  reward \d\.\d{3} ± \d\.\d{3}  \d+ tok/s  elapsed 0:00:0\d  ETA 0:00:00", last), live
    assert summary.startswith("thundersync: 3/3 steps in 0:00:0")


def test_run_settings_in_the_file_name_the_metrics_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = _small(tmp_path, extra='[run]\nmetrics = "from-file.jsonl"\nprogress = "off"\n')
    assert main(["run", str(path)]) == 0
    assert _records(tmp_path / "from-file.jsonl")[-1]["status"] == "ok"


def test_an_invalid_file_exits_2_with_one_paragraph_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[stages.reward]\ntype = "reward"\nfactr = 1\n')
    for command in ("check", "run"):
        assert main([command, str(bad)]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"thundersync: invalid pipeline (DefinitionError): {bad}: stages.reward.factr: unknown "
            "field; valid fields: reads, feedback, capacity, output, objects, concurrency, overlong, max_tokens, "
            "overlong_buffer, overlong_penalty_factor\n"
        )


def test_a_failing_object_factory_exits_2_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _small(tmp_path).read_text().replace('factory = "policy-clock"', 'factory = "policy-clock"\nversion = -1')
    (tmp_path / "p.toml").write_text(path)
    assert main(["check", str(tmp_path / "p.toml")]) == 0  # check calls no factory
    capsys.readouterr()
    assert main(["run", str(tmp_path / "p.toml")]) == 2
    assert capsys.readouterr().err == (
        f"thundersync: invalid pipeline (DefinitionError): {tmp_path / 'p.toml'}: "
        "objects.policy: policy-clock failed: a policy version must be >= 0, got -1\n"
    )


def test_a_graph_error_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _small(tmp_path).read_text().replace('reads = ["generate", "reward"]', 'reads = ["generate"]')
    (tmp_path / "g.toml").write_text(path)
    assert main(["check", str(tmp_path / "g.toml")]) == 2
    assert f"(GraphError): {tmp_path / 'g.toml'}: stage 'close' waits for Rewarded events" in capsys.readouterr().err


def test_a_failing_stage_exits_1_naming_the_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # two step stages publish to one policy clock: the second publishes version 1 again
    path = _small(tmp_path, extra='[stages.step2]\ntype = "step"\nreads = ["close"]\n')
    metrics = tmp_path / "m.jsonl"
    assert main(["run", str(path), "--metrics", str(metrics)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("thundersync: run failed (StageFailed): stage 'step")
    assert "ConfigError: policy version 1 was published after version 1" in err
    assert err.endswith("(run with --verbose for the traceback)\n") and err.count("\n") == 1
    assert _records(metrics)[-1]["status"] == "failed"
    assert main(["run", str(path), "--verbose"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_run_past_its_timeout_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _small(tmp_path, generator="delay_s = 5.0")
    assert main(["run", str(path), "--timeout", "0.2"]) == 1
    assert "the run took longer than its timeout of 0.2 s" in capsys.readouterr().err


def test_a_metrics_path_that_is_a_directory_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(_small(tmp_path)), "--metrics", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"thundersync: invalid settings (ConfigError): the metrics path {tmp_path} is a directory, "
        "not a regular file; give --metrics (or run.metrics) the path of a new file\n"
    )


def test_a_metrics_file_in_a_missing_directory_exits_2_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "out"
    assert main(["run", str(_small(tmp_path)), "--metrics", str(missing / "m.jsonl")]) == 2
    assert f"its directory {missing} does not exist; create it first (mkdir -p {missing})" in capsys.readouterr().err
    assert not missing.exists()


def test_an_existing_metrics_file_is_replaced_only_with_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("an earlier run\n")
    assert main(["run", str(_small(tmp_path)), "--metrics", str(metrics)]) == 2
    assert f"the metrics file {metrics} already exists" in capsys.readouterr().err
    assert metrics.read_text() == "an earlier run\n"
    assert main(["run", str(_small(tmp_path)), "--metrics", str(metrics), "--overwrite"]) == 0
    assert _records(metrics)[-1]["status"] == "ok"


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs Linux /proc")
def test_a_special_file_as_metrics_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(_small(tmp_path)), "--metrics", "/proc/version"]) == 2
    assert "the metrics file /proc/version already exists" in capsys.readouterr().err
    assert main(["run", str(_small(tmp_path)), "--metrics", "/proc/version", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"thundersync: invalid settings \(ConfigError\): cannot write the metrics file /proc/version: "
        r"(Input/output error|Permission denied); give --metrics \(or run\.metrics\) the path of a "
        r"regular file on a writable file system\n",
        err,
    ), err
    assert main(["run", str(_small(tmp_path)), "--metrics", "/dev/null", "--overwrite"]) == 2
    assert "the metrics path /dev/null is a character device, not a regular file" in capsys.readouterr().err


def test_check_escapes_control_characters_in_the_names_it_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ctl.toml"
    path.write_text(
        '[objects.generator]\nfactory = "test-scripted-generator"\n'
        '[stages."src\\u001b[31m"]\ntype = "source"\nprompts = [[1, 2]]\n'
        '[stages."gen\\nfake: ok"]\ntype = "generate"\nreads = ["src\\u001b[31m"]\noutput = true\n'
    )
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1:3] == [
        "  src\\x1b[31m: type source, a source",
        "  gen\\nfake: ok: type generate, reads src\\x1b[31m",
    ]


def test_errors_escape_control_characters_from_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ctl.toml"
    path.write_text('[stages."s\\u001b[2J\\u202e"]\ntype = "source"\nx = 1\n')
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "stages.s\\x1b[2J\\u202e.x: unknown field" in err and "\x1b" not in err and err.count("\n") == 1


def test_the_summary_line_escapes_the_metrics_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(_small(tmp_path)), "--metrics", str(tmp_path / "m\x07.jsonl")]) == 0
    err = capsys.readouterr().err
    assert err.endswith(f"; metrics: {tmp_path}/m\\x07.jsonl\n") and "\x07" not in err


def test_a_file_nested_too_deeply_exits_2_naming_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "deep.toml"
    path.write_text('[stages.s]\ntype = "source"\nprompts = ' + "[" * 500 + "]" * 500 + "\n")
    assert main(["check", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"thundersync: invalid pipeline (DefinitionError): {path}: the file nests tables and arrays "
        "more than 32 levels deep; pipeline files need only a few levels, so flatten the deepest value\n"
    )


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_timeout_that_is_not_positive_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(_small(tmp_path)), "--timeout", value])
    assert exit_.value.code == 2
    assert f"argument --timeout: must be a number of seconds > 0, got {value!r}" in capsys.readouterr().err


def test_python_dash_m_thundersync_checks_and_runs_the_example(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    check = subprocess.run(
        [sys.executable, "-m", "thundersync", "check", str(EXAMPLE)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert check.returncode == 0 and "ok, 7 stages" in check.stdout, check.stderr
    metrics = tmp_path / "m.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "thundersync", "run", str(EXAMPLE), "--metrics", str(metrics)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert _records(metrics)[-1]["status"] == "ok"
    bad = subprocess.run(
        [sys.executable, "-m", "thundersync", "check", str(tmp_path / "none.toml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "cannot read the pipeline file" in bad.stderr


def test_resume_without_a_checkpointer_exits_2_and_says_what_to_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", str(_small(tmp_path)), "--resume", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"thundersync: invalid settings (ConfigError): --resume {tmp_path} needs a checkpointer among the "
        "file's objects, and there is none; give the step stage a Checkpointer, or run without --resume\n"
    )


def test_a_run_whose_rewards_carry_no_signal_says_so_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "m.jsonl"
    # one sample per group: each group's one reward equals itself, so every advantage is 0
    path = _small(tmp_path, extra="[run]\nsteps = 4\n")
    assert main(["run", str(path), "--set", "stages.source.samples=1", "--metrics", str(metrics)]) == 0
    err = capsys.readouterr().err
    assert err.count("no reward signal for 3 steps in a row") == 1, err
    steps = [r for r in _records(metrics) if r["event"] == "step"]
    assert [(s["groups_rewarded"], s["groups_without_signal"]) for s in steps] == [(1, 1)] * 4
