"""A trajectory holds one sandbox from its first tool call to its release: the same files across its
turns, its task's content placed first, reset and returned (or destroyed) after, slots counted."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from typing import Any

import anyio
import pytest

from thundersync.errors import EpisodeError, SandboxUnavailable
from thundersync.events import ActionGenerated
from thundersync.sandboxes import ExecResult
from thundersync.scheduling import Admission
from thundersync.testing import FakeSandbox
from thundersync.tools import ByteTokenizer, SandboxToolRunner, ToolResult, coding_tools, default_tools

pytestmark = pytest.mark.anyio
TOKENS = ByteTokenizer()


def action(*calls: dict[str, Any], group: Hashable = 0, trajectory: Hashable = 0, turn: int = 0) -> ActionGenerated:
    text = "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)
    return ActionGenerated(group_id=group, trajectory_id=trajectory, turn=turn, token_ids=TOKENS.encode(text))


def responses(result: ToolResult) -> list[str]:
    text = TOKENS.decode(result.token_ids)
    return [part.split("\n</tool_response>")[0] for part in text.split("<tool_response>\n")[1:]]


def runner(made: list[FakeSandbox], make: Callable[[], FakeSandbox] = FakeSandbox, **kwargs: Any) -> SandboxToolRunner:
    def new() -> FakeSandbox:
        made.append(make())
        return made[-1]

    tools = [*coding_tools().values(), *default_tools().values()]
    return SandboxToolRunner(new, tools=tools, **kwargs)


def create(path: str, content: str) -> dict[str, Any]:
    return {"name": "create", "arguments": {"path": path, "content": content}}


def view(path: str) -> dict[str, Any]:
    return {"name": "view", "arguments": {"path": path}}


async def test_a_trajectory_keeps_its_sandbox_across_turns() -> None:
    made: list[FakeSandbox] = []
    async with runner(made) as tools:
        await tools.run_turn(action(create("notes.txt", "turn one")), {})
        result = await tools.run_turn(action(view("notes.txt"), turn=1), {})
    assert responses(result) == ["1\tturn one"]
    assert len(made) == 1


async def test_two_trajectories_never_share_a_sandbox_or_its_files() -> None:
    made: list[FakeSandbox] = []
    async with runner(made) as tools:
        await tools.run_turn(action(create("mine.txt", "a"), trajectory=0), {})
        other = await tools.run_turn(action(view("mine.txt"), trajectory=1), {})
        assert len(made) == 2 and tools.sessions.peek((0, 0)) is not tools.sessions.peek((0, 1))
    assert responses(other)[0].startswith("error: cannot read 'mine.txt'")


async def test_the_sandbox_is_reset_and_reused_after_the_trajectory_ends() -> None:
    made: list[FakeSandbox] = []
    async with runner(made) as tools:
        await tools.run_turn(action(create("planted", "x"), trajectory=0), {})
        await tools.trajectory_ended(0, 0)
        assert made[0].log[-1] == "reset" and tools.sessions.peek((0, 0)) is None
        result = await tools.run_turn(action(view("planted"), trajectory=1), {})
    assert len(made) == 1 and responses(result)[0].startswith("error: cannot read 'planted'")


async def test_with_release_at_close_the_sandbox_outlives_the_final_action_until_the_close() -> None:
    made: list[FakeSandbox] = []
    async with runner(made) as tools:
        tools.release_at("close")
        await tools.run_turn(action(create("kept", "x")), {})
        await tools.trajectory_ended(0, 0)
        assert tools.sessions.peek((0, 0)) is not None and "reset" not in made[0].log
        await tools.trajectory_closed(0, 0)
        assert tools.sessions.peek((0, 0)) is None and made[0].log[-1] == "reset"


async def test_a_sandbox_whose_reset_cannot_prove_it_clean_is_destroyed_and_replaced() -> None:
    made: list[FakeSandbox] = []
    async with runner(made, lambda: FakeSandbox(reset_ok=False)) as tools:
        await tools.run_turn(action(create("a", "x"), trajectory=0), {})
        await tools.trajectory_ended(0, 0)
        assert made[0].closed
        await tools.run_turn(action(create("a", "x"), trajectory=1), {})
    assert len(made) == 2 and made[0].closed and made[1].closed


async def test_warm_sandboxes_start_on_entry_and_are_taken_first() -> None:
    made: list[FakeSandbox] = []
    async with runner(made, max_sandboxes=3, warm=2) as tools:
        assert len(made) == 2
        await tools.run_turn(action(create("a", "x")), {})
        assert len(made) == 2 and tools.sessions.pools.stats.reused == 1


async def test_the_tasks_content_is_placed_and_its_setup_runs_before_the_first_call() -> None:
    made: list[FakeSandbox] = []
    task = {"environment": {"files": {"src/app.py": "print(1)\n"}, "setup": ["touch ready", ["echo", "set up"]]}}
    async with runner(made) as tools:
        result = await tools.run_turn(action(view("/work/src/app.py")), task)
    assert responses(result) == ["1\tprint(1)"]
    assert made[0].log[:2] == ["exec /bin/sh -c touch ready", "exec echo set up"]


async def test_a_setup_that_fails_is_an_episode_error_naming_task_trajectory_tool_and_cause() -> None:
    def fail(sandbox: FakeSandbox, argv: list[str], stdin: bytes | None) -> ExecResult:
        return ExecResult(exit_code=3, stdout="", stderr="no such package")

    made: list[FakeSandbox] = []
    task = {"id": "t-7", "environment": {"setup": ["pip install nothing"]}}
    async with runner(made, lambda: FakeSandbox(run=fail)) as tools:
        with pytest.raises(
            EpisodeError,
            match=r"^setup command 'pip install nothing' exited with 3: no such package \(episode failed: "
            r"task 't-7', trajectory 2 of group 0, tool 'setup'\)$",
        ):
            await tools.run_turn(action(view("x"), trajectory=2), task)
        assert len(tools.sessions) == 0 and made[0].log[-1] == "reset"  # given back, not held


async def test_a_sandbox_that_cannot_start_is_an_episode_error() -> None:
    def broken() -> FakeSandbox:
        raise SandboxUnavailable("the Docker daemon does not answer")

    async with runner([], broken) as tools:
        with pytest.raises(
            EpisodeError, match=r"^the Docker daemon does not answer \(episode failed: .*tool 'sandbox'\)$"
        ):
            await tools.run_turn(action(view("x")), {})


async def test_a_task_naming_an_image_gets_a_sandbox_from_that_images_pool() -> None:
    images: list[str] = []

    def by_image(image: str) -> FakeSandbox:
        images.append(image)
        return FakeSandbox()

    tools = SandboxToolRunner(FakeSandbox, images=by_image, image="base:1", tools=coding_tools().values())
    async with tools:
        await tools.run_turn(action(view("x"), trajectory=0), {"environment": {"image": "repo-a:1"}})
        await tools.run_turn(action(view("x"), trajectory=1), {"environment": {"image": "base:1"}})
        await tools.run_turn(action(view("x"), trajectory=2), {})
    assert images == ["repo-a:1"]  # the runner's own image comes from its default factory


async def test_a_runner_of_one_image_fails_the_episode_of_a_task_naming_another() -> None:
    async with SandboxToolRunner(FakeSandbox, image="base:1", tools=coding_tools().values()) as tools:
        with pytest.raises(EpisodeError, match=r"the task asks for image 'other:2', but this runner's sandboxes"):
            await tools.run_turn(action(view("x")), {"environment": {"image": "other:2"}})


async def test_admission_sandbox_slots_count_trajectories_holding_a_sandbox() -> None:
    admission = Admission(sandbox_slots=1)
    made: list[FakeSandbox] = []
    tools = runner(made, max_sandboxes=4)
    tools.use_slots(admission)
    second_started = anyio.Event()
    async with tools:
        await tools.run_turn(action(create("a", "1"), trajectory=0), {})
        # a call that needs no sandbox takes no slot
        await tools.run_turn(action({"name": "submit", "arguments": {}}, trajectory=1), {})
        assert admission.stats().sandbox_holders == 1

        async def second() -> None:
            await tools.run_turn(action(create("b", "2"), trajectory=2), {})
            second_started.set()

        async with anyio.create_task_group() as group:
            group.start_soon(second)
            await anyio.sleep(0.05)
            assert not second_started.is_set()  # waits: the first trajectory holds the one slot
            await tools.trajectory_ended(0, 0)
            await second_started.wait()
        assert admission.stats().sandbox_holders == 1 and admission.stats().waits_by_reason["sandbox_slots"] == 1
    assert admission.stats().sandbox_holders == 0  # leaving the runner gives back every sandbox


class HalfCallTools:
    """Odd trajectories call a tool on their first two turns; even ones answer at once."""

    async def generate(self, request: Any) -> Any:
        from thundersync.generation.base import GenerationResult

        trajectory = str(request.session_id).split("/")[1]
        turn = self.turns.get(request.session_id, 0)
        self.turns[request.session_id] = turn + 1
        calls = int(trajectory) % 2 == 1 and turn < 2
        text = f"<tool_call>{json.dumps(create(f'f{turn}', 'x'))}</tool_call>" if calls else "done"
        await anyio.sleep(0.001)
        ids = TOKENS.encode(text)
        return GenerationResult(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop", prompt_len=0)

    def __init__(self) -> None:
        self.turns: dict[Any, int] = {}


async def test_many_trajectories_over_few_sandboxes_slots_and_grading_slots_never_deadlock() -> None:
    from thundersync.pipeline import Graph, run_graph
    from thundersync.stages.close import CloseStage
    from thundersync.stages.generate import GenerateStage
    from thundersync.stages.reward import RewardStage
    from thundersync.stages.source import SourceStage
    from thundersync.stages.tool_execute import ToolExecuteStage
    from thundersync.tasks import Task, TaskGrader
    from thundersync.tools import Qwen3ToolCallParser

    class Tasks:
        def tasks(self) -> list[Task]:
            return [Task(prompt_ids=[1, 2], fields={"environment": {"grade": "true"}}) for _ in range(4)]

    admission = Admission(sandbox_slots=2)
    made: list[FakeSandbox] = []
    tools = runner(made, max_sandboxes=2, grade_sandboxes=1)
    source = SourceStage(SourceStage.Config(samples=6), tasks=Tasks(), admission=admission)
    graph = (
        Graph()
        .add("source", source)
        .add(
            "generate",
            GenerateStage(GenerateStage.Config(turns=3), generator=HalfCallTools(), tool_calls=Qwen3ToolCallParser()),
            reads=["source"],
            feedback=["tool-execute"],
        )
        .add(
            "tool-execute",
            ToolExecuteStage(ToolExecuteStage.Config(concurrency=1), tools=tools, admission=admission),
            reads=["generate"],
        )
        .add(
            "reward",
            RewardStage(RewardStage.Config(concurrency=1), scorer=TaskGrader(tools=tools)),
            reads=["generate", "tool-execute"],
        )
        .add("close", CloseStage(tools=tools, admission=admission), reads=["generate", "reward"], output=True)
    )
    with anyio.fail_after(30):
        stats = await run_graph(graph)
    assert stats is not None and admission.stats().sandbox_holders == 0
    assert len(made) <= 3  # two for the trajectories, one for grading the ones that used none
