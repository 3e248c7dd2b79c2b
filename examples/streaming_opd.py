"""One streamed on-policy distillation update, checked against the dense full-batch update.

    python examples/streaming_opd.py [--device cuda] [--seed 0]

A small random Qwen3 student learns from a different small random Qwen3 teacher (both built in
code, no download). Several multi-turn trajectories with tool-observation turns are streamed: each
action's teacher scores arrive right after it is generated, and the action is backpropagated at
once; gradients that later actions send into earlier turns' K/V state are replayed when the
trajectory closes. Then one AdamW step on the streamed gradient. The script prints one JSON line:
the loss, the gradient norm, the relative error of the streamed gradient against the ordinary
forward + backward of the same loss, and how far the step moved the parameters; it exits 1 when
the error passes the fp32 tolerance (``TOLERANCE``, 1e-5).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import thundersync

VOCAB = 128
TOLERANCE = 1e-5  # fp32 relative error of the streamed gradient against the dense one


def small_qwen3(seed: int, hidden: int, device: str) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).to(device).eval()


@torch.no_grad()
def sample_turn(model: Qwen3ForCausalLM, context: list[int], length: int, gen: torch.Generator) -> list[int]:
    """Sample ``length`` tokens from the student (plain full-context sampling; fine for a demo)."""
    tokens = list(context)
    device = next(model.parameters()).device
    for _ in range(length):
        logits = model(torch.tensor([tokens], device=device)).logits[0, -1].float()
        tokens.append(int(torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=gen)))
    return tokens[len(context) :]


@torch.no_grad()
def token_logprobs(model: Qwen3ForCausalLM, sequence: list[int], start: int) -> list[float]:
    """Log-probs of ``sequence[start:]`` under ``model`` given everything before."""
    device = next(model.parameters()).device
    logp = torch.log_softmax(model(torch.tensor([sequence], device=device)).logits[0].float(), -1)
    ids = torch.tensor(sequence, device=device)
    return logp[torch.arange(start - 1, len(sequence) - 1, device=device), ids[start:]].tolist()


def rollouts(student: Qwen3ForCausalLM, seed: int) -> list[tuple[str, list[int], list[list[int]], list[bool]]]:
    """Two groups x three trajectories; each alternates actions and tool observations."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    batch = []
    for g in range(2):
        prompt = [rng.randrange(VOCAB) for _ in range(12)]
        for i in range(3):
            context, turns, is_action = list(prompt), [], []
            for k in range(rng.randint(2, 4)):
                action = k % 2 == 0
                turn = (
                    sample_turn(student, context, rng.randint(3, 8), gen)
                    if action
                    else [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
                )
                turns.append(turn)
                is_action.append(action)
                context += turn
            batch.append((f"g{g}/t{i}", prompt, turns, is_action))
    return batch


def dense_loss(student: Qwen3ForCausalLM, batch, scores) -> torch.Tensor:
    """The same loss over full sequences with the ordinary forward (the reference)."""
    terms = []
    for (_name, prompt, turns, is_action), (teacher, behaviour) in zip(batch, scores):
        seq, start_of = list(prompt), []
        for turn in turns:
            start_of.append(len(seq))
            seq += turn
        logp = torch.log_softmax(student(torch.tensor([seq], device=student.device)).logits[0].float(), -1)
        for k, turn in enumerate(turns):
            if not is_action[k]:
                continue
            pos = torch.arange(start_of[k], start_of[k] + len(turn), device=student.device)
            lp = logp[pos - 1, torch.tensor(seq, device=student.device)[pos]]
            q = torch.tensor(teacher[k], device=lp.device)
            b = torch.tensor(behaviour[k], device=lp.device)
            terms.append((torch.exp(lp - b) * (b - q)).sum())
    count = sum(len(t) for (_, _, turns, acts) in batch for t, a in zip(turns, acts) if a)
    return torch.stack(terms).sum() / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    student = small_qwen3(args.seed, 64, args.device)
    teacher = small_qwen3(args.seed + 1, 96, args.device)
    batch = rollouts(student, args.seed)

    # Teacher and behaviour scores, per action turn (a real pipeline gets these as events).
    scores = []
    for _, prompt, turns, is_action in batch:
        seq, teacher_lp, behaviour_lp = list(prompt), [], []
        for turn, action in zip(turns, is_action):
            start = len(seq)
            seq += turn
            teacher_lp.append(token_logprobs(teacher, seq, start) if action else [])
            behaviour_lp.append(token_logprobs(student, seq, start) if action else [])
        scores.append((teacher_lp, behaviour_lp))

    started = time.perf_counter()
    opd = thundersync.OPDStream(thundersync.StreamingRun(student), normalization="token_mean")
    groups = sorted({name.split("/")[0] for name, *_ in batch})
    for g in groups:
        opd.open_group(g, next(p for name, p, *_ in batch if name.startswith(g + "/")))
    # Interleave the trajectories turn by turn, as concurrent agents would.
    depth = max(len(turns) for _, _, turns, _ in batch)
    for k in range(depth):
        for (name, _, turns, is_action), (teacher_lp, behaviour_lp) in zip(batch, scores):
            if k < len(turns):
                g, t = name.split("/")
                action = is_action[k]
                opd.append_turn(
                    g,
                    t,
                    turns[k],
                    [action] * len(turns[k]),
                    teacher_logprobs=teacher_lp[k] if action else None,
                    behaviour_logprobs=behaviour_lp[k] if action else None,
                )
                if k == len(turns) - 1:
                    opd.close_trajectory(g, t)
    for g in groups:
        opd.close_group(g)
    opd.assert_safe_to_step()
    streamed_seconds = time.perf_counter() - started
    streamed = [p.grad.clone() for p in student.parameters()]

    student.zero_grad(set_to_none=True)
    loss = dense_loss(student, batch, scores)
    loss.backward()
    dense = [p.grad for p in student.parameters()]
    diff = sum(float((s - d).double().pow(2).sum()) for s, d in zip(streamed, dense)) ** 0.5
    norm = sum(float(d.double().pow(2).sum()) for d in dense) ** 0.5
    error = diff / norm

    for p, g in zip(student.parameters(), streamed):  # the update uses the streamed gradient
        p.grad = g
    before = [p.detach().clone() for p in student.parameters()]
    torch.optim.AdamW(student.parameters(), lr=1e-3).step()
    moved = sum(float((p.detach() - b).double().pow(2).sum()) for p, b in zip(student.parameters(), before)) ** 0.5
    print(
        json.dumps(
            {
                "loss": float(loss.detach()),
                "grad_norm": norm,
                "relative_error": error,
                "tolerance": TOLERANCE,
                "within_tolerance": error < TOLERANCE,
                "step_moved_parameters_by": moved,
                "trajectories": len(batch),
                "device": args.device,
                "streamed_seconds": round(streamed_seconds, 4),
            }
        )
    )
    if not error < TOLERANCE:
        raise SystemExit(f"streamed gradient is {error:.3g} from the dense one, past the tolerance {TOLERANCE:g}")


if __name__ == "__main__":
    main()
