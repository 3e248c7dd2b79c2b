"""A pipeline file is code: ``check`` lists what it would import and read, and ``api_key_env``
names only a key's variable unless the file says otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from thundersync.app.cli.command import main
from thundersync.app.factories.generators import openai_generator
from thundersync.app.files.definition import loads
from thundersync.app.files.trust import reach
from thundersync.errors import ConfigError

FILE = """\
[objects.generator]
factory = "openai-generator"
base_url = "http://127.0.0.1:9"
model = "m"
api_key_env = "{variable}"
{extra}
[objects.scorer]
factory = "function-reward"
function = "tests.tasks.grading_rewards:broken"
[stages.source]
type = "source"
prompts = [[1, 2]]
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


@pytest.fixture(autouse=True)
def _restore_logging() -> None:
    structlog.reset_defaults()


def test_check_lists_the_modules_a_file_imports_and_the_variables_it_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "f.toml"
    path.write_text(FILE.format(variable="SERVER_API_KEY", extra=""))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "  imports: thundersync.app.factories.generators (objects.generator.factory), thundersync.tasks.rewards "
        "(objects.scorer.factory), tests.tasks.grading_rewards (objects.scorer.function)\n" in out
    )
    assert "  reads the environment variables: SERVER_API_KEY (objects.generator.api_key_env)\n" in out


def test_reach_finds_targets_inside_tables_and_arrays() -> None:
    spec = loads(
        '[objects.app]\nfactory = "function-app"\nfunction = "pkg/agent.py:run"\n'
        '[stages.source]\ntype = "source"\nprompts = [[1]]\n'
    )
    assert reach(spec).modules == {
        "thundersync.agents.app": ["objects.app.factory"],
        "pkg/agent.py": ["objects.app.function"],
    }


@pytest.mark.parametrize("variable", ["HOME", "AWS_SECRET_ACCESS_KEY_ID", "openai_api_key"])
def test_an_api_key_env_that_names_no_key_is_refused_by_check_and_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], variable: str
) -> None:
    path = tmp_path / "f.toml"
    path.write_text(FILE.format(variable=variable, extra=""))
    assert main(["check", str(path)]) == 2
    message = f"objects.generator.api_key_env names {variable!r}, which does not look like a key's variable"
    assert message in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"set allow_any_env = true"):
        openai_generator(base_url="http://127.0.0.1:9", model="m", api_key_env=variable)
    path.write_text(FILE.format(variable=variable, extra="allow_any_env = true"))
    assert main(["check", str(path)]) == 0


@pytest.mark.parametrize("variable", ["OPENAI_API_KEY", "HF_TOKEN", "SERVER_SECRET"])
def test_an_api_key_env_that_names_a_key_is_accepted(tmp_path: Path, variable: str) -> None:
    path = tmp_path / "f.toml"
    path.write_text(FILE.format(variable=variable, extra=""))
    assert main(["check", str(path)]) == 0


def test_run_help_says_a_file_is_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "A pipeline file is code" in " ".join(capsys.readouterr().out.split())
