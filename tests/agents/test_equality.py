"""An episode driven through the OpenAI-client path trains exactly like the same episode driven
through the generate stage: same tokens, same behaviour log-probs, same gradient (fp64)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

import thundersync
from tests.engine.tiny_models import use_native_norms
from tests.tools.chat_helpers import chat
from thundersync.agents import AppEpisode
from thundersync.events import ActionGenerated, BatchReady, EventBase, ToolObserved
from thundersync.generation import TorchGenerator
from thundersync.pipeline import Graph, Pipeline
from thundersync.stages.agent_app import AgentAppStage
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepResult, StepStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.tasks import Task
from thundersync.testing import FakeScorer
from thundersync.tools import ChatTemplate, ToolCall, ToolResult, default_tools

CALCULATOR = default_tools()["calculator"].schema
QUESTIONS = ["What is 17 * 23?", "What is 2 + 3 * 4?"]
TURNS, SAMPLES, MAX_NEW_TOKENS, SEED = 3, 3, 6, 11


def _model(vocab: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(config).to(torch.float64)
    use_native_norms(model)
    return model.eval()


def _messages(question: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": question}]


def _result(turn: int) -> str:
    return f"result {turn}"


class AlwaysCalls:
    """Generate's parser: every action calls the tool (a random model writes no calls itself)."""

    def parse(self, token_ids: Sequence[int]) -> list[ToolCall]:
        return [ToolCall(name="calculator")]

    def observation(self, responses: Sequence[str]) -> str:
        raise AssertionError("unused")


class TemplateTool:
    """Tool-execute's runner: the template's observation of the turn's result."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template

    async def run(self, action: ActionGenerated) -> ToolResult:
        message = {"role": "tool", "content": _result(action.turn)}
        return ToolResult(token_ids=self.template.observation_ids([message], after=action.token_ids))


class LoopApp:
    """The same agent written against the OpenAI client: ask, observe the tool's result, ask again."""

    async def run(self, episode: AppEpisode) -> float | None:
        client, messages = episode.client(), list(episode.messages or [])
        for turn in range(TURNS):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            messages.append(reply.choices[0].message)
            if turn < TURNS - 1:
                messages.append({"role": "tool", "content": _result(turn)})
        return None


class GradientOf:
    """The step stage's trainer: keeps the batch's gradient instead of stepping."""

    def __init__(self, grpo: thundersync.RewardLinearBackward) -> None:
        self.grpo, self.grads = grpo, [torch.zeros(0)]

    async def step(self, ready: BatchReady) -> StepResult:
        await anyio.to_thread.run_sync(self.grpo.assert_safe_to_step)
        params = self.grpo.run.params
        self.grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        for p in params:
            p.grad = None
        return StepResult()


def _learner(graph: Graph, model: torch.nn.Module, producer: str) -> GradientOf:
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model))
    trainer = GradientOf(grpo)
    graph.add(
        "reward", RewardStage(scorer=FakeScorer()), reads=[producer, *(["tool"] if producer == "generate" else [])]
    )
    reads = [producer, "reward", *(["tool"] if producer == "generate" else [])]
    graph.add("backward", BackwardStage(objective=grpo), reads=reads)
    graph.add(
        "close", CloseStage(CloseStage.Config(wait_for=("reward", "backward"))), reads=[producer, "reward", "backward"]
    )
    graph.add("step", StepStage(trainer=trainer), reads=["close"])
    return trainer


async def _run(graph: Graph) -> list[EventBase]:
    async with Pipeline(graph) as pipeline:
        await pipeline.close()
        return [event async for event in pipeline.results()]


def _through_generate(model: torch.nn.Module, template: ChatTemplate) -> tuple[list[EventBase], list[torch.Tensor]]:
    prompts = [template.prompt_ids(_messages(q), tools=[CALCULATOR]) for q in QUESTIONS]
    generate = GenerateStage(
        GenerateStage.Config(
            max_new_tokens=MAX_NEW_TOKENS, turns=TURNS, seed=SEED, stop_token_ids=template.stop_token_ids
        ),
        generator=TorchGenerator(model),
        tool_calls=AlwaysCalls(),
    )
    graph = Graph().add("source", SourceStage(SourceStage.Config(prompts=prompts, samples=SAMPLES)))
    graph.add("generate", generate, reads=["source"], feedback=["tool"], output=True)
    graph.add("tool", ToolExecuteStage(tools=TemplateTool(template)), reads=["generate"], output=True)
    trainer = _learner(graph, model, "generate")
    return anyio.run(_run, graph), trainer.grads


class _Tasks:
    def tasks(self) -> list[Task]:
        return [Task(prompt_ids=[1], fields={"messages": _messages(q)}) for q in QUESTIONS]


def _through_app(model: torch.nn.Module, template: ChatTemplate) -> tuple[list[EventBase], list[torch.Tensor]]:
    app = AgentAppStage(
        AgentAppStage.Config(max_new_tokens=MAX_NEW_TOKENS, seed=SEED, rewards="stage"),
        app=LoopApp(),
        generator=TorchGenerator(model),
        chat=template,
    )
    graph = Graph().add("source", SourceStage(SourceStage.Config(samples=SAMPLES), tasks=_Tasks()))
    graph.add("app", app, reads=["source"], output=True)
    trainer = _learner(graph, model, "app")
    return anyio.run(_run, graph), trainer.grads


def _turns(events: list[EventBase], kind: type[EventBase]) -> dict[tuple[Any, Any, int], Any]:
    return {(e.group_id, e.trajectory_id, e.turn): e for e in events if isinstance(e, kind)}  # type: ignore[attr-defined]


@pytest.mark.slow
def test_an_app_episode_trains_exactly_like_the_generate_stage() -> None:
    template = chat("qwen3", tools=False)
    model = _model(len(template.tokenizer))
    generated, generated_grads = _through_generate(model, template)
    served, served_grads = _through_app(model, template)
    actions, replies = _turns(generated, ActionGenerated), _turns(served, ActionGenerated)
    assert len(actions) == len(QUESTIONS) * SAMPLES * TURNS and actions.keys() == replies.keys()
    for key, action in actions.items():
        reply = replies[key]
        assert reply.token_ids == action.token_ids and reply.final == action.final
        assert max(abs(a - b) for a, b in zip(reply.behaviour_logprobs, action.behaviour_logprobs)) < 1e-10
    observed, answered = _turns(generated, ToolObserved), _turns(served, ToolObserved)
    assert observed.keys() == answered.keys() and len(observed) == len(QUESTIONS) * SAMPLES * (TURNS - 1)
    assert all(answered[key].token_ids == o.token_ids for key, o in observed.items())
    assert any(o.token_ids[0] == template.end_of_turn_id for o in observed.values())  # actions cut short, closed
    norm = torch.sqrt(sum((g**2).sum() for g in generated_grads))
    assert norm > 0
    diff = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(generated_grads, served_grads)))
    assert float(diff / norm) < 1e-10
