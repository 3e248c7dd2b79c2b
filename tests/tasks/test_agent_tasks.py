"""The agent example's task side: arithmetic options, calculator demonstrations, a teacher from a run's checkpoints."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from thundersync.errors import ConfigError
from thundersync.events import ActionGenerated
from thundersync.sandboxes import SandboxLimits, make_sandbox
from thundersync.sandboxes._process import unshare_available
from thundersync.sandboxes.local import NotIsolatedWarning
from thundersync.tasks import AnswerReward, ArithmeticTasks, CalculatorDemonstrations, Demonstration, Task
from thundersync.tasks.demonstrations import estimate
from thundersync.tools import ByteTokenizer, Qwen3ToolCallParser, SandboxToolRunner

END = 256
TOKENS = ByteTokenizer()
PRODUCTS = ArithmeticTasks(count=8, seed=3, terms=2, operators=("*",), low=317, high=999)


def _pieces(demo: Demonstration) -> list[tuple[bool, list[int]]]:
    """The demonstration's runs of written and read tokens, in order."""
    pieces: list[tuple[bool, list[int]]] = []
    for token, written in zip(demo.token_ids, demo.written):
        if not pieces or pieces[-1][0] != written:
            pieces.append((written, []))
        pieces[-1][1].append(token)
    return pieces


def test_arithmetic_tasks_draw_the_given_terms_and_operators() -> None:
    for task in PRODUCTS.tasks():
        expression = task.fields["expression"]
        assert len(expression) == 9 and expression[3:6] == " * "
        assert task.fields["answer"] == str(eval(expression)) and len(task.fields["answer"]) == 6
    with pytest.raises(
        ConfigError, match=r"need terms >= 2 and operators from '\+', '-', '\*'; got terms=3, operators=\['/'\]"
    ):
        ArithmeticTasks(operators=("/",))  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore::thundersync.sandboxes.local.NotIsolatedWarning")
async def test_a_calculator_demonstration_is_the_episode_the_agent_loop_produces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its call parses with the Qwen3 parser; the calculator, run in a local sandbox, answers with its
    observation; its final answer earns the reward."""
    problem = unshare_available()
    if problem is not None:
        pytest.skip(f"the local sandbox backend cannot run here: {problem}")
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(tmp_path))
    task = PRODUCTS.tasks()[0]
    demo = CalculatorDemonstrations(tasks=PRODUCTS, end_token_id=END).demonstration(task)
    (_, prompt), (_, call), (_, observation), (_, answer) = _pieces(demo)
    assert prompt == task.prompt_ids and call[-1] == END and answer[-1] == END
    assert Qwen3ToolCallParser(TOKENS).parse(call) == [
        Qwen3ToolCallParser.parse_text(
            f'<tool_call>{{"name": "calculator", "arguments": {{"expression": '
            f'"{task.fields["expression"]}"}}}}</tool_call>'
        )[0]
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotIsolatedWarning)
        runner = SandboxToolRunner(lambda: make_sandbox("local", limits=SandboxLimits(timeout_s=10.0)))
    async with runner:
        result = await runner.run(ActionGenerated(group_id=0, trajectory_id=0, turn=0, token_ids=call))
    assert result.token_ids == observation and result.exit_status == 0
    reward = await AnswerReward().score_task(prompt, call + observation + answer, task.fields)
    assert TOKENS.decode(answer) == f"<answer>{task.fields['answer']}</answer>" and reward == 1.0


def test_all_demonstrations_come_in_the_tasks_order() -> None:
    demos = CalculatorDemonstrations(tasks=PRODUCTS, end_token_id=END).demonstrations()
    tasks = PRODUCTS.tasks()
    assert [d.token_ids[: len(t.prompt_ids)] for d, t in zip(demos, tasks)] == [t.prompt_ids for t in tasks]
    assert len(demos) == len(tasks)
    assert CalculatorDemonstrations.call("1 + 2") == (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'
    )


def test_a_share_of_demonstrations_answers_at_once_with_an_estimate() -> None:
    """direct_fraction: that share of the episodes (seeded) is the prompt and a two-digit estimate,
    a well-formed answer the reward scores as wrong; the rest are calculator episodes."""
    tasks = ArithmeticTasks(count=400, seed=5, terms=2, operators=("*",), low=317, high=999)
    mixed = CalculatorDemonstrations(tasks=tasks, end_token_id=END, direct_fraction=0.25, seed=7).demonstrations()
    assert (
        mixed == CalculatorDemonstrations(tasks=tasks, end_token_id=END, direct_fraction=0.25, seed=7).demonstrations()
    )
    direct = 0
    for demo, task in zip(mixed, tasks.tasks()):
        pieces = _pieces(demo)
        if len(pieces) == 2:
            direct += 1
            value = int(task.fields["answer"])
            written = TOKENS.decode(pieces[1][1][:-1])
            assert written == f"<answer>{round(value, -4)}</answer>" and pieces[1][1][-1] == END
        else:
            assert len(pieces) == 4
    assert 70 <= direct <= 130  # 100 expected of 400
    assert all(len(_pieces(d)) == 4 for d in CalculatorDemonstrations(tasks=tasks, end_token_id=END).demonstrations())
    assert estimate("287663") == "290000" and estimate("-4521") == "-4500" and estimate("95") == "95"
    with pytest.raises(ConfigError, match=r"needs an integer answer, got '1.5'"):
        estimate("1.5")
    with pytest.raises(ConfigError, match=r"direct_fraction is a share of the episodes, in \[0, 1\]; got 1.5"):
        CalculatorDemonstrations(tasks=tasks, end_token_id=END, direct_fraction=1.5)


def test_thinking_restates_the_expression_a_long_tailed_number_of_times() -> None:
    """think_repeats: every episode's first action opens with <think>, the expression on that many
    lines (lognormal around think_repeats, in 1..think_max), </think>; the rest of the episode is the
    one without thinking; think_repeats = 0 changes nothing."""
    tasks = ArithmeticTasks(count=600, seed=5, terms=2, operators=("*",), low=317, high=999)
    plain = CalculatorDemonstrations(tasks=tasks, end_token_id=END, direct_fraction=0.5, seed=7)
    thinking = CalculatorDemonstrations(
        tasks=tasks, end_token_id=END, direct_fraction=0.5, seed=7, think_repeats=4, think_sigma=1.0, think_max=30
    )
    assert (
        plain.demonstrations()
        == CalculatorDemonstrations(
            tasks=tasks, end_token_id=END, direct_fraction=0.5, seed=7, think_repeats=0
        ).demonstrations()
    )
    repeats = []
    for demo, task in zip(thinking.demonstrations(), tasks.tasks()):
        expression = task.fields["expression"]
        first = TOKENS.decode(_pieces(demo)[1][1][:-1])
        head, _, rest = first.partition("</think>")
        lines = head.removeprefix("<think>").split("\n")
        assert head.startswith("<think>") and lines[-1] == "" and set(lines[:-1]) == {expression}
        repeats.append(len(lines) - 1)
        without = plain.demonstration(task, direct=not rest.startswith("<tool_call>"))
        assert TOKENS.decode(_pieces(without)[1][1][:-1]) == rest
        assert (
            demo.token_ids[len(_pieces(demo)[1][1]) + len(task.prompt_ids) :]
            == without.token_ids[len(_pieces(without)[1][1]) + len(task.prompt_ids) :]
        )
    repeats.sort()
    assert repeats[0] >= 1 and repeats[-1] == 30  # the cap is reached: 4 * e^2 > 30 (a 2-sigma draw)
    assert 3 <= repeats[len(repeats) // 2] <= 5 and repeats[int(0.9 * len(repeats))] >= 10  # median ~4, long tail
    with pytest.raises(
        ConfigError,
        match=r"think_repeats >= 0 \(0: none\), think_sigma >= 0 and think_max >= 1; got "
        r"think_repeats=2, think_sigma=1.0, think_max=0",
    ):
        CalculatorDemonstrations(tasks=tasks, end_token_id=END, think_repeats=2, think_max=0)


def test_a_calculator_demonstration_needs_an_expression_and_an_answer() -> None:
    demos = CalculatorDemonstrations(tasks=PRODUCTS, end_token_id=END)
    with pytest.raises(
        ConfigError,
        match=r"needs text fields 'expression' and 'answer'; this task has \['answer'\], "
        r"missing \['expression'\]",
    ):
        demos.demonstration(Task(prompt_ids=[1], fields={"answer": "3"}))
    with pytest.raises(
        ConfigError,
        match=r"one written flag per token and at least one written token; got 2 tokens, "
        r"1 flags, 0 written",
    ):
        Demonstration([1, 2], [False])
