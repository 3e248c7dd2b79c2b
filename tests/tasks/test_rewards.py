"""The module:function reward, the exact-answer reward, and the reward stage handing them task fields."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from thundersync.errors import ConfigError
from thundersync.tasks import AnswerReward, FunctionReward, parse_answer

pytestmark = pytest.mark.anyio

MODULE = """
import anyio

def length(prompt, completion, task):
    return len(completion) + float(task.get("bonus", 0))

async def later(prompt, completion, task):
    await anyio.sleep(0)
    return 0.5 if prompt == [1, 2] else -1.0

def broken(prompt, completion, task):
    return "high"

NOT_CALLABLE = 3
"""


@pytest.fixture
def rewards_module(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "my_rewards.py").write_text(MODULE)
    sys.path.insert(0, str(tmp_path))
    yield "my_rewards"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("my_rewards", None)


async def test_a_sync_function_gets_text_and_the_task_fields(rewards_module: str) -> None:
    reward = FunctionReward(function=f"{rewards_module}:length")
    assert await reward.score_task(list(b"q"), list(b"abc"), {"bonus": 2}) == 5.0


async def test_an_async_function_can_take_token_ids(rewards_module: str) -> None:
    reward = FunctionReward(function=f"{rewards_module}:later", text=False)
    assert await reward.score_task([1, 2], [3], {}) == 0.5


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("my_rewards.length", r"a reward function is given as 'module:function', got 'my_rewards\.length'"),
        ("no_such_module_x:f", r"cannot import module 'no_such_module_x' of reward function 'no_such_module_x:f': "),
        (
            "my_rewards:missing",
            r"module 'my_rewards' has no attribute 'missing' \(reward function 'my_rewards:missing'\)",
        ),
        ("my_rewards:NOT_CALLABLE", r"reward function 'my_rewards:NOT_CALLABLE' is a int, not a callable"),
    ],
)
def test_a_bad_function_path_says_what_is_wrong(rewards_module: str, path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FunctionReward(function=path)


async def test_a_function_returning_a_non_number_fails_with_its_value(rewards_module: str) -> None:
    reward = FunctionReward(function=f"{rewards_module}:broken")
    with pytest.raises(ValueError, match=r"reward function 'my_rewards:broken' returned 'high'; it must return"):
        await reward.score_task([1], [2], {})


@pytest.mark.parametrize(
    ("text", "last_number", "expected"),
    [
        ("so <answer> 42 </answer>", False, "42"),
        ("<answer>1</answer> no, <answer>2</answer>", False, "2"),
        ("the result is 9, then 10.5", False, None),
        ("the result is 9, then 1,010.5", True, "1,010.5"),
        ("no numbers", True, None),
    ],
)
def test_parse_answer_takes_the_last_tag_or_optionally_the_last_number(
    text: str, last_number: bool, expected: str | None
) -> None:
    assert parse_answer(text, last_number=last_number) == expected


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("<tool_response>9943</tool_response> <answer>9943</answer>", 1.0),
        ("<answer>9,943.0</answer>", 1.0),
        ("<answer>9944</answer>", 0.1),
        ("<tool_response>9943</tool_response> I think so.", 0.0),
    ],
)
async def test_the_answer_reward_is_one_for_the_right_answer_and_small_for_the_format(
    completion: str, reward: float
) -> None:
    scorer = AnswerReward()
    assert await scorer.score_task([1], list(completion.encode()), {"answer": "9943"}) == reward


async def test_the_answer_reward_names_a_missing_field() -> None:
    with pytest.raises(ValueError, match=r"the task has no 'answer' field \(fields: \['expected'\]\)"):
        await AnswerReward().score_task([1], [2], {"expected": "3"})


def test_format_reward_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"format_reward must be in \[0, 1\], got 2"):
        AnswerReward(format_reward=2)


async def test_the_reward_stage_hands_the_task_fields_to_a_task_scorer(run_stage: Any) -> None:
    from thundersync.events import ActionGenerated, GroupOpened, Rewarded
    from thundersync.stages.reward import RewardStage

    events = [
        GroupOpened(group_id=0, prompt_tokens=[1], trajectory_ids=[0, 1], task={"answer": "7"}),
        ActionGenerated(group_id=0, trajectory_id=0, turn=0, token_ids=list(b"<answer>7</answer>"), final=True),
        ActionGenerated(group_id=0, trajectory_id=1, turn=0, token_ids=list(b"<answer>8</answer>"), final=True),
    ]
    out = await run_stage(RewardStage(scorer=AnswerReward()), events)
    assert sorted(out, key=lambda e: e.trajectory_id) == [
        Rewarded(group_id=0, trajectory_id=0, reward=1.0),
        Rewarded(group_id=0, trajectory_id=1, reward=0.1),
    ]


def test_the_reward_stage_refuses_an_object_that_scores_nothing() -> None:
    from thundersync.stages.reward import RewardStage

    with pytest.raises(ConfigError, match=r"the reward stage's scorer is a int, which has none of score\("):
        RewardStage(scorer=3)  # type: ignore[arg-type]  # the wrong type is the point
