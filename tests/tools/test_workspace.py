"""Per-task environments: checked where they are read, their content (files, a directory, an
archive, a local git repository at a commit) placed from the host, their changes computed."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from thundersync.errors import ConfigError
from thundersync.testing import FakeSandbox
from thundersync.tools import TaskEnvironment, Workspaces, environment_of, task_name, tree_changes

pytestmark = pytest.mark.anyio


def git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, env=env)
    return done.stdout.strip()


def make_repo(path: Path, versions: list[dict[str, str]]) -> list[str]:
    """A git repository at ``path`` with one commit per version of its files; the commit ids."""
    path.mkdir(parents=True)
    git(path, "init", "-q")
    commits = []
    for files in versions:
        for name, text in files.items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_text(text)
        git(path, "add", "-A")
        git(path, "commit", "-qm", "v")
        commits.append(git(path, "rev-parse", "HEAD"))
    return commits


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"directory": "/a", "repo": "/b"}, "places one of directory, archive and repo"),
        ({"commit": "abc"}, "needs a repo"),
        ({"repo": "/r", "commit": "--upload-pack=x"}, "must be a commit id or ref name"),
        ({"reward": "fraction"}, "needs the named tests"),
        ({"reward": "best"}, "use 'all_pass', 'fraction' or a 'module:function'"),
        ({"grade_in": "elsewhere"}, "Invalid enum value 'elsewhere'"),
        ({"colour": "blue"}, "unknown field `colour`"),
    ],
)
def test_a_bad_environment_is_refused_saying_what_is_wrong(raw: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match="the task's environment is invalid: .*" + says.replace("(", r"\(")):
        environment_of({"environment": raw})


def test_a_task_is_named_by_its_id_fields_else_its_group() -> None:
    assert task_name({"instance_id": "astropy-1"}, 3) == "'astropy-1'"
    assert task_name({"answer": "4"}, 3) == "of group 3"
    assert environment_of({"answer": "4"}) is None


async def test_a_git_repository_is_placed_at_the_commit_asked_for(tmp_path: Path) -> None:
    first, _ = make_repo(tmp_path / "repo", [{"a.py": "v1\n"}, {"a.py": "v2\n", "b.py": "new\n"}])
    sandbox = FakeSandbox()
    env = TaskEnvironment(repo=str(tmp_path / "repo"), commit=first, files={"extra.txt": "x"})
    async with Workspaces() as workspaces:
        await workspaces.place(sandbox, env)
        baseline = await workspaces.baseline(env)
    assert sandbox.files["a.py"] == b"v1\n" and "b.py" not in sandbox.files and sandbox.files["extra.txt"] == b"x"
    assert any(path.startswith(".git/") for path in sandbox.files)  # the history comes along
    assert baseline == {"a.py": b"v1\n", "extra.txt": b"x"}  # .git is not part of what is compared


async def test_a_directory_and_an_archive_are_placed_as_they_are(tmp_path: Path) -> None:
    (tmp_path / "dir" / "pkg").mkdir(parents=True)
    (tmp_path / "dir" / "pkg" / "m.py").write_text("m\n")
    with tarfile.open(tmp_path / "a.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "dir" / "pkg", arcname="pkg")
    async with Workspaces() as workspaces:
        for env in (
            TaskEnvironment(directory=str(tmp_path / "dir")),
            TaskEnvironment(archive=str(tmp_path / "a.tar.gz")),
        ):
            sandbox = FakeSandbox()
            await workspaces.place(sandbox, env)
            assert sandbox.files == {"pkg/m.py": b"m\n"}


async def test_an_archive_member_that_escapes_is_refused(tmp_path: Path) -> None:
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../outside.txt")
        info.size = 0
        tar.addfile(info)
    async with Workspaces() as workspaces:
        with pytest.raises(ConfigError, match=r"cannot extract environment.archive .*outside"):
            await workspaces.place(FakeSandbox(), TaskEnvironment(archive=str(evil)))
    assert not (tmp_path / "outside.txt").exists()


async def test_a_repository_that_is_not_a_local_directory_is_refused_nothing_is_fetched() -> None:
    async with Workspaces() as workspaces:
        with pytest.raises(ConfigError, match=r"environment.repo 'https://github.com/a/b' is not a local directory"):
            await workspaces.place(FakeSandbox(), TaskEnvironment(repo="https://github.com/a/b"))


async def test_a_commit_that_is_not_in_the_repository_names_it(tmp_path: Path) -> None:
    make_repo(tmp_path / "repo", [{"a.py": "1"}])
    async with Workspaces() as workspaces:
        with pytest.raises(ConfigError, match=r"cannot place .* at deadbeef"):
            await workspaces.place(FakeSandbox(), TaskEnvironment(repo=str(tmp_path / "repo"), commit="deadbeef"))


def test_tree_changes_are_the_modified_new_and_deleted_files(tmp_path: Path) -> None:
    (tmp_path / "same.py").write_text("s")
    (tmp_path / "edited.py").write_text("after")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "n.py").write_text("n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_text("ignored")
    baseline = {"same.py": b"s", "edited.py": b"before", "gone.py": b"g"}
    changed, deleted = tree_changes(baseline, tmp_path)
    assert changed == {"edited.py": b"after", "new/n.py": b"n"} and deleted == ["gone.py"]
