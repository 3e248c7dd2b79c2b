"""`Graph`: stages composed by name, with typed, bounded edges between them.

A graph is a list of named stages and, for each, the names it ``reads`` from. An edge
``producer -> consumer`` carries only the event types the consumer ``consumes``: a producer that
feeds several consumers sends each event to the consumers that accept its type (fan-out by type),
and a consumer that reads from several producers gets one merged inbox in arrival order::

    graph = Graph()
    graph.add("source", PromptSource(cfg))                      # consumes == (): a source
    graph.add("gen", Generate(cfg, generator=g), reads=["source"], capacity=64)
    graph.add("tool", ToolExecute(), reads=["gen"])
    graph.add("reward", Reward(), reads=["gen", "tool"])        # several producers, one inbox
    graph.validate()

``capacity`` bounds the consumer's inbox: a full inbox blocks its producers (backpressure). The
reserved name ``"input"`` stands for events an application sends through
:class:`~thundersync.pipeline.Pipeline`.

The ``reads`` edges must be acyclic. A loop such as the agent's generate -> tool-execute ->
generate is declared on the stage that closes it, as a **feedback edge**::

    graph.add("gen", Generate(cfg, generator=g, tool_calls=parser), reads=["source"], feedback=["tool"])
    graph.add("tool", ToolExecute(tools=runner), reads=["gen"])

A feedback edge feeds a second inbox of its consumer (``inbox.feedback``), apart from the forward
inbox, so the consumer can tell "no more new work" (its forward inbox ended) from "no more answers"
(its feedback inbox ended); it must close its outbox itself once its forward inbox ended and no work
waits on the loop, which ends the loop's stages in turn (see ``runner.py``). A feedback producer must
be downstream of its consumer (else it is not a loop: put it in ``reads``); an undeclared cycle is
refused with its path. Feedback that is not a stream of events, such as a published policy
(step -> generate), goes through a runtime object both stages share
(:class:`~thundersync.pipeline.policy.PolicyClock`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from thundersync.errors import GraphError
from thundersync.pipeline.stage import Stage

__all__ = ["DEFAULT_CAPACITY", "INPUT", "Graph", "Node"]

INPUT = "input"
"""The reserved name of the application's input (what ``Pipeline.send`` writes to)."""

DEFAULT_CAPACITY = 64
"""Inbox size of a stage when ``Graph.add`` is not given one."""


@dataclass(frozen=True)
class Node:
    """One stage in a graph: its name, the stage, the names it reads from (forward edges, then
    feedback edges), its inbox size."""

    name: str
    stage: Stage
    reads: tuple[str, ...]
    capacity: int
    output: bool
    feedback: tuple[str, ...] = ()

    @property
    def inputs(self) -> tuple[str, ...]:
        """Every stage this one reads from: its forward ``reads``, then its ``feedback``."""
        return self.reads + self.feedback

    @property
    def is_source(self) -> bool:
        return not self.stage.consumes


def _names(types: Iterable[type]) -> str:
    return ", ".join(t.__name__ for t in types) or "nothing"


def _overlap(produces: Iterable[type], consumes: Iterable[type]) -> bool:
    return any(issubclass(p, c) or issubclass(c, p) for p in produces for c in consumes)


class Graph:
    """Named stages and the edges between them; see the module docstring."""

    def __init__(self) -> None:
        self._nodes: dict[str, Node] = {}

    def add(
        self,
        name: str,
        stage: Stage,
        *,
        reads: Iterable[str] = (),
        capacity: int = DEFAULT_CAPACITY,
        output: bool = False,
        feedback: Iterable[str] = (),
    ) -> Graph:
        """Add ``stage`` under ``name``, reading from the stages named in ``reads``.

        ``capacity`` is the size of its inbox (>= 1; a feedback inbox has the same size).
        ``output=True`` makes the events it produces results of a :class:`Pipeline` (by default
        the results are the events of the stages no other stage reads from). ``feedback`` names
        downstream stages whose events come back to this one (see the module docstring). Returns
        the graph, so calls can be chained.
        """
        reads = (reads,) if isinstance(reads, str) else tuple(reads)
        feedback = (feedback,) if isinstance(feedback, str) else tuple(feedback)
        self._check_new(name, stage, reads + feedback, capacity)
        self._nodes[name] = Node(name, stage, reads, capacity, output, feedback)
        return self

    def _check_new(self, name: str, stage: Stage, reads: tuple[str, ...], capacity: int) -> None:
        if not isinstance(name, str) or not name:
            raise GraphError(f"a stage name must be a non-empty string, got {name!r}")
        if name == INPUT:
            raise GraphError(f"{INPUT!r} is reserved for the application's input; pick another name")
        if name in self._nodes:
            raise GraphError(f"a stage named {name!r} already exists; stages: {self._listing()}")
        if not isinstance(stage, Stage):
            raise GraphError(
                f"stage {name!r} is a {type(stage).__name__}, not a thundersync Stage; "
                "subclass thundersync.pipeline.Stage"
            )
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise GraphError(f"stage {name!r} has capacity {capacity!r}; it must be an int >= 1")
        duplicates = sorted({r for r in reads if reads.count(r) > 1})
        if duplicates:
            raise GraphError(f"stage {name!r} reads from {', '.join(duplicates)} more than once")

    # --- queries -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def __getitem__(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise GraphError(f"no stage named {name!r}; stages: {self._listing()}") from None

    def readers(self, name: str) -> list[Node]:
        """The stages that read from ``name`` (a stage name or ``"input"``), in insertion order."""
        return [node for node in self._nodes.values() if name in node.inputs]

    def outputs(self) -> list[Node]:
        """The stages whose events are a Pipeline's results: declared ones, else the terminal ones."""
        declared = [node for node in self._nodes.values() if node.output]
        if declared:
            return declared
        return [node for node in self._nodes.values() if not self.readers(node.name)]

    def __repr__(self) -> str:
        def describe(node: Node) -> str:
            loop = f" <~ {', '.join(node.feedback)}" if node.feedback else ""
            return (f"{node.name} <- {', '.join(node.reads)}" if node.reads else node.name) + loop

        return f"Graph({'; '.join(describe(node) for node in self._nodes.values())})"

    def _listing(self) -> str:
        return ", ".join(self._nodes) or "(none)"

    # --- validation ----------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise :class:`GraphError` listing every problem, or return when the graph can run."""
        if not self._nodes:
            raise GraphError("the graph has no stages; add some with Graph.add(name, stage)")
        problems = [p for node in self._nodes.values() for p in self._node_problems(node)]
        if not problems:
            problems = self._cycle_problems()
        if problems:
            raise GraphError("; ".join(problems))

    def _node_problems(self, node: Node) -> Iterator[str]:
        stage = node.stage
        if node.is_source and node.reads:
            yield (
                f"stage {node.name!r} reads from {', '.join(node.reads)} but consumes no event "
                f"types (it is a source); drop reads= or set {type(stage).__name__}.consumes"
            )
            return
        if not node.is_source and not node.reads:
            yield (
                f"stage {node.name!r} consumes {_names(stage.consumes)} but reads from no stage; "
                f"pass reads=[...] (stages: {self._listing()}, or {INPUT!r})"
            )
        for upstream in node.inputs:
            if upstream == INPUT:
                continue
            producer = self._nodes.get(upstream)
            if producer is None:
                yield (
                    f"stage {node.name!r} reads from {upstream!r}, which no stage produces; stages: {self._listing()}"
                )
            elif not _overlap(producer.stage.produces, stage.consumes):
                yield (
                    f"stage {node.name!r} reads from {upstream!r}, but {upstream!r} produces "
                    f"{_names(producer.stage.produces)} and {node.name!r} consumes "
                    f"{_names(stage.consumes)}: no event type in common"
                )
        yield from self._feedback_problems(node)

    def _feedback_problems(self, node: Node) -> Iterator[str]:
        for producer in node.feedback:
            if producer == INPUT:
                yield f"stage {node.name!r} declares feedback from {INPUT!r}; the application's input is never a loop"
            elif producer in self._nodes and node.name not in self._upstream(producer):
                yield (
                    f"stage {node.name!r} declares feedback from {producer!r}, but {producer!r} does not "
                    f"read from {node.name!r} (directly or through other stages), so there is no loop; "
                    f"put {producer!r} in reads=[...] instead"
                )

    def _upstream(self, name: str) -> set[str]:
        """Every stage ``name`` reads from along forward edges, directly or not."""
        seen: set[str] = set()
        pending = [name]
        while pending:
            node = self._nodes.get(pending.pop())
            for upstream in node.reads if node is not None else ():
                if upstream not in seen:
                    seen.add(upstream)
                    pending.append(upstream)
        return seen

    def _cycle_problems(self) -> list[str]:
        cycle = self.cycle()
        if cycle is None:
            return []
        return [
            f"stages form a cycle: {' -> '.join(reversed(cycle))}; reads=[...] edges must be acyclic (an "
            f"undeclared cycle never reaches end-of-stream): declare the edge that closes an intended loop "
            f"as feedback (Graph.add({cycle[0]!r}, ..., feedback=[{cycle[1]!r}])), or pass state such as a "
            "published policy through a runtime object both stages share (thundersync.pipeline.policy.PolicyClock)"
        ]

    def cycle(self) -> list[str] | None:
        """A cycle of ``reads`` edges (feedback edges excluded), or None.

        The cycle is listed along ``reads``: ``["a", "b", "a"]`` means a reads b and b reads a, so
        declaring ``feedback=["b"]`` on ``a`` (instead of reads) breaks it.
        """
        state: dict[str, int] = {}  # 1: on the current path, 2: finished

        def visit(start: str) -> list[str] | None:
            """Depth-first along ``reads`` with an explicit stack (a long chain must not overflow)."""
            path = [start]
            stack = [iter(self._nodes[start].reads)]
            state[start] = 1
            while stack:
                upstream = next(stack[-1], None)
                if upstream is None:
                    state[path.pop()] = 2
                    stack.pop()
                elif upstream == INPUT or upstream not in self._nodes or state.get(upstream) == 2:
                    continue
                elif state.get(upstream) == 1:
                    return [*path[path.index(upstream) :], upstream]
                else:
                    state[upstream] = 1
                    path.append(upstream)
                    stack.append(iter(self._nodes[upstream].reads))
            return None

        for name in self._nodes:
            if name not in state and (found := visit(name)) is not None:
                return found
        return None
