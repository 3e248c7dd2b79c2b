"""Graph composition and validation: every mistake is reported with what exists."""

from __future__ import annotations

import pytest

from tests.pipeline.runtime_stages import Collect, Emit, Pass, Tack, Tick, Tock
from thundersync.errors import GraphError
from thundersync.pipeline import Graph
from thundersync.pipeline.graph import DEFAULT_CAPACITY


def _chain() -> Graph:
    return Graph().add("gen", Emit(count=1)).add("tool", Pass(), reads=["gen"])


def test_unknown_upstream_names_the_missing_stage_and_lists_the_existing_ones() -> None:
    graph = _chain().add("reward", Collect(), reads=["gen2"])
    with pytest.raises(
        GraphError, match="stage 'reward' reads from 'gen2', which no stage produces; stages: gen, tool, reward"
    ):
        graph.validate()


def test_duplicate_stage_name_is_rejected_when_added() -> None:
    with pytest.raises(GraphError, match="a stage named 'gen' already exists; stages: gen, tool"):
        _chain().add("gen", Collect(), reads=["tool"])


def test_input_is_a_reserved_name() -> None:
    with pytest.raises(GraphError, match="'input' is reserved for the application's input"):
        Graph().add("input", Emit())


@pytest.mark.parametrize("capacity", [0, -3, 1.5, True])
def test_capacity_below_one_or_not_an_int_is_rejected(capacity: object) -> None:
    with pytest.raises(GraphError, match=rf"stage 'sink' has capacity {capacity!r}; it must be an int >= 1"):
        Graph().add("sink", Collect(), reads=["gen"], capacity=capacity)  # type: ignore[arg-type]


def test_reading_the_same_stage_twice_is_rejected() -> None:
    with pytest.raises(GraphError, match="stage 'sink' reads from gen more than once"):
        Graph().add("sink", Collect(), reads=["gen", "gen"])


def test_a_stage_must_be_a_stage_instance() -> None:
    with pytest.raises(GraphError, match="stage 'f' is a function, not a thundersync Stage"):
        Graph().add("f", lambda: None)  # type: ignore[arg-type]


def test_a_consumer_sharing_no_type_with_its_producer_names_both_type_lists() -> None:
    graph = Graph().add("gen", Pass(consumes=(Tick,), produces=(Tock,)), reads=["src"])
    graph.add("src", Emit()).add("sink", Collect(consumes=(Tack, Tick)), reads=["gen"])
    with pytest.raises(
        GraphError,
        match="stage 'sink' reads from 'gen', but 'gen' produces Tock and 'sink' consumes Tack, Tick: no event type in common",
    ):
        graph.validate()


def test_a_non_source_without_inputs_is_rejected() -> None:
    graph = Graph().add("src", Emit()).add("sink", Collect())
    with pytest.raises(
        GraphError,
        match=r"stage 'sink' consumes Tick but reads from no stage; pass reads=\[...\] \(stages: src, sink, or 'input'\)",
    ):
        graph.validate()


def test_a_source_with_inputs_is_rejected() -> None:
    graph = Graph().add("a", Emit()).add("b", Emit(), reads=["a"])
    with pytest.raises(GraphError, match="stage 'b' reads from a but consumes no event types \\(it is a source\\)"):
        graph.validate()


def test_a_cycle_is_rejected_and_shown_in_flow_order() -> None:
    graph = Graph().add("src", Emit())
    graph.add("gen", Pass(), reads=["src", "step"]).add("backward", Pass(), reads=["gen"])
    graph.add("step", Pass(), reads=["backward"])
    with pytest.raises(
        GraphError,
        match=r"stages form a cycle: gen -> backward -> step -> gen; reads=\[...\] edges must be acyclic .* "
        r"declare the edge that closes an intended loop as feedback \(Graph.add\('gen', ..., feedback=\['step'\]\)\)",
    ):
        graph.validate()


def test_a_declared_feedback_edge_closes_a_loop_without_a_cycle_error() -> None:
    graph = Graph().add("src", Emit())
    graph.add("gen", Pass(), reads=["src"], feedback=["step"]).add("backward", Pass(), reads=["gen"])
    graph.add("step", Pass(), reads=["backward"])
    graph.validate()
    assert graph["gen"].reads == ("src",) and graph["gen"].feedback == ("step",)
    assert [node.name for node in graph.readers("step")] == ["gen"]
    assert repr(graph) == "Graph(src; gen <- src <~ step; backward <- gen; step <- backward)"


def test_feedback_from_a_stage_that_is_not_downstream_is_refused() -> None:
    graph = Graph().add("src", Emit()).add("other", Pass(), reads=["src"])
    graph.add("gen", Pass(), reads=["src"], feedback=["other"])
    with pytest.raises(
        GraphError,
        match=r"stage 'gen' declares feedback from 'other', but 'other' does not read from 'gen' .* "
        r"so there is no loop; put 'other' in reads=\[...\] instead",
    ):
        graph.validate()


def test_feedback_from_the_input_or_from_a_stage_also_in_reads_is_refused() -> None:
    with pytest.raises(GraphError, match="stage 'gen' reads from src more than once"):
        Graph().add("src", Emit()).add("gen", Pass(), reads=["src"], feedback=["src"])
    graph = Graph().add("src", Emit()).add("gen", Pass(), reads=["src"], feedback=["input"])
    with pytest.raises(
        GraphError, match="stage 'gen' declares feedback from 'input'; the application's input is never"
    ):
        graph.validate()


def test_a_long_chain_and_a_long_cycle_are_checked_without_recursion() -> None:
    graph = Graph()
    for i in range(3000, 0, -1):  # downstream first: the check walks the whole chain from s3000
        graph.add(f"s{i}", Pass(), reads=[f"s{i - 1}"])
    graph.add("s0", Pass(), reads=["input"])
    graph.validate()
    looped = Graph()
    for i in range(3000, 0, -1):
        looped.add(f"s{i}", Pass(), reads=[f"s{i - 1}"])
    looped.add("s0", Pass(), reads=["s3000"])
    with pytest.raises(
        GraphError, match=r"^stages form a cycle: s3000 -> s0 -> s1 -> s2 -> .* -> s2999 -> s3000; reads="
    ):
        looped.validate()


def test_a_stage_reading_itself_is_a_cycle() -> None:
    graph = Graph().add("src", Emit()).add("loop", Pass(), reads=["src", "loop"])
    with pytest.raises(GraphError, match="stages form a cycle: loop -> loop"):
        graph.validate()


def test_every_problem_is_reported_at_once() -> None:
    graph = Graph().add("a", Collect(), reads=["x"]).add("b", Collect(), reads=["y"])
    with pytest.raises(GraphError, match="'a' reads from 'x'.*; stage 'b' reads from 'y'"):
        graph.validate()


def test_an_empty_graph_is_rejected() -> None:
    with pytest.raises(GraphError, match="the graph has no stages"):
        Graph().validate()


def test_a_valid_graph_lists_nodes_readers_and_terminal_outputs() -> None:
    graph = _chain().add("reward", Collect(consumes=(Tick,)), reads=["gen", "tool"], capacity=3)
    graph.validate()
    assert [node.name for node in graph] == ["gen", "tool", "reward"]
    assert [node.name for node in graph.readers("gen")] == ["tool", "reward"]
    assert [node.name for node in graph.outputs()] == ["reward"]
    assert graph["reward"].capacity == 3 and graph["tool"].capacity == DEFAULT_CAPACITY
    assert "tool" in graph and len(graph) == 3


def test_declared_outputs_replace_the_terminal_stages() -> None:
    graph = Graph().add("gen", Emit()).add("tool", Pass(), reads=["gen"], output=True)
    graph.add("sink", Collect(), reads=["tool"])
    assert [node.name for node in graph.outputs()] == ["tool"]


def test_looking_up_an_unknown_stage_lists_the_stages() -> None:
    with pytest.raises(GraphError, match="no stage named 'nope'; stages: gen, tool"):
        _chain()["nope"]


def test_reading_from_input_needs_no_stage_named_input() -> None:
    Graph().add("gen", Pass(), reads=["input"]).validate()


def test_a_base_type_consumer_accepts_a_subclass_producer() -> None:
    from thundersync.events import EventBase

    Graph().add("src", Emit()).add("all", Collect(consumes=(EventBase,)), reads=["src"]).validate()


def test_a_graph_shows_who_reads_from_whom() -> None:
    assert repr(_chain()) == "Graph(gen; tool <- gen)"


@pytest.mark.parametrize("name", ["", 3])
def test_a_stage_name_must_be_a_non_empty_string(name: object) -> None:
    with pytest.raises(GraphError, match=f"a stage name must be a non-empty string, got {name!r}"):
        Graph().add(name, Emit())  # type: ignore[arg-type]
