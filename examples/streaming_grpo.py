"""One streamed GRPO update of a small random Qwen3, checked against the dense gradient.

    python examples/streaming_grpo.py            # CPU in seconds; CUDA when available

Two groups of multi-turn trajectories (policy turns scored, tool observations not) are streamed
through ``RewardLinearBackward`` with their closes interleaved across the groups, as rollouts
finish in any order. After ``assert_safe_to_step()`` every ``p.grad`` holds the gradient of the
GRPO objective; the same gradient computed densely (each full sequence through the model's
ordinary forward) gives the relative error. Then one AdamW(maximize=True) step. Prints one JSON
line and exits 1 when the relative error passes the fp32 tolerance (``TOLERANCE``, 1e-5: the
streamed and dense sums differ only in rounding order).
"""

from __future__ import annotations

import copy
import json
import math
import random

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import thundersync

VOCAB, EPS = 128, 1e-6
TOLERANCE = 1e-5  # fp32 relative error of the streamed gradient against the dense one


def make_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config).to(device).eval()


def make_batch(
    rng: random.Random,
) -> dict[str, tuple[list[int], list[list[tuple[list[int], list[bool]]]], list[float]]]:
    """group -> (prompt, trajectories as lists of (tokens, scored) turns, rewards)."""
    batch = {}
    for group in ("math-1", "code-7"):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(8, 16))]
        trajectories, rewards = [], []
        for _ in range(4):
            turns = []
            for turn in range(rng.randint(1, 3)):
                n = rng.randint(3, 12)
                scored = turn % 2 == 0  # policy turns, then tool observations
                turns.append(([rng.randrange(VOCAB) for _ in range(n)], [scored] * n))
            trajectories.append(turns)
            rewards.append(float(rng.random() < 0.5))
        rewards[0], rewards[1] = 0.0, 1.0  # a group with a reward signal
        batch[group] = (prompt, trajectories, rewards)
    return batch


def stream(model: torch.nn.Module, batch: dict, rng: random.Random) -> None:
    grpo = thundersync.RewardLinearBackward(thundersync.StreamingRun(model), eps=EPS, estimator="grpo")
    events = []
    for group, (prompt, trajectories, rewards) in batch.items():
        grpo.open_group(group, prompt)
        for i, turns in enumerate(trajectories):
            events.append([("append", group, i, turn) for turn in turns] + [("close", group, i, rewards[i])])
    open_count = {group: len(t) for group, (_, t, _) in batch.items()}
    while events:  # finish rollouts in a random order across both groups
        queue = rng.choice(events)
        op = queue.pop(0)
        if not queue:
            events.remove(queue)
        if op[0] == "append":
            grpo.append_turn(op[1], op[2], *op[3])
        else:
            grpo.close_trajectory(op[1], op[2], op[3])
            open_count[op[1]] -= 1
            if open_count[op[1]] == 0:
                grpo.close_group(op[1])
    grpo.assert_safe_to_step()


def dense(model: torch.nn.Module, batch: dict) -> None:
    objective = 0.0
    for prompt, trajectories, rewards in batch.values():
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        for turns, reward in zip(trajectories, rewards):
            ids = torch.tensor(
                prompt + [t for tokens, _ in turns for t in tokens], device=next(model.parameters()).device
            )
            scored = torch.tensor([False] * len(prompt) + [s for _, flags in turns for s in flags], device=ids.device)
            logp = model(input_ids=ids[None]).logits[0].float().log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]
            objective = objective + (reward - mean) / (std + EPS) * logp[scored[1:]].sum()
    objective.backward()  # type: ignore[union-attr]


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = make_model(device)
    reference = copy.deepcopy(model)
    batch = make_batch(random.Random(0))
    stream(model, batch, random.Random(1))
    dense(reference, batch)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    want = torch.cat([p.grad.flatten() for p in reference.parameters()])
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, maximize=True)
    optimizer.step()
    moved = float((torch.cat([p.detach().flatten() for p in model.parameters()]) - before).norm())
    error = float((got - want).norm() / want.norm())
    print(
        json.dumps(
            {
                "device": device.type,
                "grad_norm": float(got.norm()),
                "relative_error_vs_dense": error,
                "tolerance": TOLERANCE,
                "within_tolerance": error < TOLERANCE,
                "step_moved_parameters_by": moved,
                "trajectories": sum(len(t) for _, t, _ in batch.values()),
            }
        )
    )
    if not error < TOLERANCE:
        raise SystemExit(f"streamed gradient is {error:.3g} from the dense one, past the tolerance {TOLERANCE:g}")


if __name__ == "__main__":
    main()
