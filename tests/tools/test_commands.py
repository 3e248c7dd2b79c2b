"""Each tool checks its arguments and builds an argv list; model output never becomes an option."""

from __future__ import annotations

import json
from typing import Any

import pytest

from thundersync.tools import CalculatorTool, Command, PythonTool, ShellTool, default_tools


def test_the_default_tools_are_calculator_python_and_shell() -> None:
    assert sorted(default_tools()) == ["calculator", "python", "shell"]


def test_shell_passes_the_command_as_one_argv_element_after_the_end_of_options() -> None:
    assert ShellTool().command({"command": "-rf; echo hi"}) == Command(["sh", "-c", "--", "-rf; echo hi"])


def test_python_sends_the_code_on_stdin() -> None:
    assert PythonTool().command({"code": "print(1)"}) == Command(["python3", "-I", "-"], stdin=b"print(1)")


def test_the_calculator_passes_the_expression_after_its_fixed_program() -> None:
    argv = CalculatorTool().command({"expression": "-3 + 4*(2)"}).argv
    assert argv[:3] == ["python3", "-I", "-c"] and argv[4:] == ["-3 + 4*(2)"]


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        (
            CalculatorTool(),
            {"expression": "__import__('os')"},
            r"calculator takes only numbers and \+ - \* / % \( \); ",
        ),
        (CalculatorTool(), {"expr": "1"}, r"^calculator takes only 'expression'; remove 'expr'$"),
        (CalculatorTool(), {}, r"^calculator needs 'expression', a non-empty string; got None$"),
        (ShellTool(), {"command": 5}, r"^shell needs 'command', a non-empty string; got 5$"),
        (PythonTool(max_chars=3), {"code": "print(1)"}, r"^python's 'code' has 8 characters; the limit is 3$"),
    ],
)
def test_bad_arguments_say_what_is_wrong(tool: Any, arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tool.command(arguments)


def test_each_default_tool_publishes_a_function_schema_of_its_arguments() -> None:
    arguments = {"calculator": "expression", "python": "code", "shell": "command"}
    for name, tool in default_tools().items():
        schema = json.loads(json.dumps(tool.schema))  # plain JSON data
        function = schema["function"]
        assert schema["type"] == "function" and function["name"] == name and function["description"]
        assert function["parameters"]["required"] == [arguments[name]]
        assert set(function["parameters"]["properties"]) == {arguments[name]}
