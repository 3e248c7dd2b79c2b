"""GRPO inside a stage graph: the model generates, a tool stage answers, a scorer rewards, and each
finished trajectory's backward runs while the rest of its group is still generating.

    python examples/pipeline_grpo.py [--steps 8]      # CPU in seconds; CUDA when available

The graph (all stages run concurrently; events flow along the edges)::

    source -> generate (TorchGenerator over the learner itself) <-> tool-execute (a scripted tool;
               |                                                    its observations feed back)
               |-> reward (share of even token ids: a toy task the policy can learn)
               |-> backward (RewardLinearBackward: streams each trajectory's gradient)
               '-> close (trajectory, group and batch boundaries) -> step (AdamW, maximize=True)

reward and backward read both generate and tool-execute, so they see every turn of a trajectory.

Generate starts batch n only on the policy of step n (a shared PolicyClock), so every batch is
on-policy and each update equals the synchronous full-batch GRPO update. Prints one JSON line
per step (mean reward of the batch, gradient norm) and a last line with the first and last
mean rewards.
"""

from __future__ import annotations

import argparse
import json
import statistics

import anyio
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import thundersync
from thundersync.events import StepDone
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.backward import BackwardStage
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage, StreamingTrainer
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import ScriptedTool

VOCAB = 128


class EvenTokens:
    """Reward: the share of even token ids among the trajectory's tokens (kept per batch)."""

    def __init__(self) -> None:
        self.rewards: list[float] = []

    async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> float:
        reward = sum(t % 2 == 0 for t in completion_ids) / max(len(completion_ids), 1)
        self.rewards.append(reward)
        return reward


def build(model: torch.nn.Module, steps: int, scorer: EvenTokens) -> tuple[thundersync.Graph, torch.optim.Optimizer]:
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), estimator="grpo")
    optimizer = torch.optim.AdamW(grpo.run.params, lr=3e-3, maximize=True)
    policy = PolicyClock()
    prompts = [[1 + 7 * k, 2 + 5 * k, 3 + 3 * k] for k in range(4)]
    graph = (
        thundersync.Graph()
        .add("source", SourceStage(SourceStage.Config(prompts=prompts, samples=8, groups_per_batch=4, repeat=steps)))
        .add(
            "generate",
            GenerateStage(
                GenerateStage.Config(turns=2, max_new_tokens=12),
                generator=thundersync.TorchGenerator(model, max_batch=32, max_seq_len=256),
                tool_calls=ScriptedTool(),  # every action but the last turn's calls the tool
                policy=policy,
            ),
            reads=["source"],
            feedback=["tool-execute"],
        )
        .add(
            "tool-execute",
            ToolExecuteStage(tools=ScriptedTool(vocab_size=VOCAB, observation_len=4)),
            reads=["generate"],
        )
        .add("reward", RewardStage(scorer=scorer), reads=["generate", "tool-execute"])
        .add("backward", BackwardStage(objective=grpo), reads=["generate", "tool-execute", "reward"])
        .add(
            "close",
            CloseStage(CloseStage.Config(wait_for=("reward", "backward"))),
            reads=["generate", "reward", "backward"],
        )
        .add(
            "step",
            StepStage(trainer=StreamingTrainer(grpo, optimizer, max_grad_norm=1.0), policy=policy),
            reads=["close"],
            output=True,
        )
    )
    return graph, optimizer


async def train(graph: thundersync.Graph, scorer: EvenTokens) -> list[float]:
    means = []
    async with thundersync.Pipeline(graph) as pipeline:
        await pipeline.close()  # the source stage makes the prompts
        async for event in pipeline.results():
            if isinstance(event, StepDone):
                means.append(statistics.fmean(scorer.rewards))
                scorer.rewards.clear()
                print(
                    json.dumps(
                        {
                            "step": event.policy_version,
                            "mean_reward": round(means[-1], 4),
                            "grad_norm": round(event.grad_norm, 4),
                        }
                    ),
                    flush=True,
                )
    return means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(config).to(device).eval()
    scorer = EvenTokens()
    graph, _ = build(model, args.steps, scorer)
    means = anyio.run(train, graph, scorer)
    print(
        json.dumps(
            {
                "steps": len(means),
                "first_mean_reward": round(means[0], 4),
                "last_mean_reward": round(means[-1], 4),
                "device": device.type,
            }
        )
    )


if __name__ == "__main__":
    main()
