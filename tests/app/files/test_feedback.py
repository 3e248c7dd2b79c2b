"""Pipeline files declare the agent loop's edge back to generate as ``feedback``; any other cycle
fails with the path of the stage whose reads close it."""

from __future__ import annotations

import pytest

from thundersync.app.files.build import build_graph
from thundersync.app.files.definition import loads
from thundersync.errors import DefinitionError

HEAD = """
[objects.generator]
factory = "test-scripted-generator"

[objects.tools]
factory = "test-scripted-tool"
end_token = 7

[stages.source]
type = "source"
prompts = [[1, 2]]
"""

LOOP = """
[stages.generate]
type = "generate"
reads = ["source"{generate_reads}]
{feedback}
objects = {{ tool_calls = "tools" }}
turns = 3

[stages.tool-execute]
type = "tool-execute"
reads = ["generate"]
"""


def test_a_feedback_table_field_builds_the_loop() -> None:
    spec = loads(HEAD + LOOP.format(generate_reads="", feedback='feedback = ["tool-execute"]'))
    assert spec.stages["generate"].feedback == ("tool-execute",)
    graph = build_graph(spec)
    assert graph["generate"].feedback == ("tool-execute",) and graph["generate"].reads == ("source",)


def test_an_undeclared_cycle_names_the_stage_whose_reads_close_it() -> None:
    spec = loads(HEAD + LOOP.format(generate_reads=', "tool-execute"', feedback=""))
    with pytest.raises(
        DefinitionError,
        match=r"^stages.generate.reads: stages form a cycle: generate -> tool-execute -> generate, which would "
        r"never end; if the loop is intended, move 'tool-execute' from reads to feedback "
        r"\(feedback = \['tool-execute'\] in \[stages.generate\]\)$",
    ):
        build_graph(spec)


def test_a_misspelt_feedback_field_lists_the_valid_ones() -> None:
    with pytest.raises(DefinitionError, match=r"stages.generate.feedbak: unknown field; valid fields: reads, feedback"):
        loads(HEAD + LOOP.format(generate_reads="", feedback='feedbak = ["tool-execute"]'))
