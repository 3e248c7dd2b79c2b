"""The segment core: per-turn backward with ledgers replayed in reverse equals the dense gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.engine.tiny_models import tiny_qwen3, with_lora
from thundersync.acceleration import Acceleration
from thundersync.engine import AdjointLedger, Segment, SegmentPack
from thundersync.engine.executor import PackExecutor
from thundersync.model.anatomy import decoder_anatomy

WEIGHTS = (0.7, 0.0, -1.3)  # turn 1 scored, turn 2 an observation, turn 3 scored


def _dense(model: torch.nn.Module, prompt: list[int], chains: list[list[list[int]]]) -> None:
    for turns in chains:
        ids = torch.tensor(prompt + [t for turn in turns for t in turn])
        logp = model(input_ids=ids[None]).logits[0].log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]
        start, total = len(prompt), 0
        for turn, weight in zip(turns, WEIGHTS):
            total = total + weight * logp[start - 1 : start - 1 + len(turn)].sum()
            start += len(turn)
        total.backward()


def _streamed(
    model: torch.nn.Module, prompt: list[int], chains: list[list[list[int]]], forms: Acceleration | None
) -> None:
    """OPD's schedule: each turn backpropagated when appended (both chains packed), ledgers replayed."""
    anatomy = decoder_anatomy(model)
    executor = PackExecutor(anatomy, forms)
    params = anatomy.trainable_parameters()
    root = Segment(torch.tensor(prompt))
    SegmentPack.forward(executor, [root], grad=False, keep_state=True)
    ledgers: dict[Segment, AdjointLedger] = {root: AdjointLedger()}
    tails, order = [root] * len(chains), []
    for turn_index, weight in enumerate(WEIGHTS):
        segments = [Segment(torch.tensor(turns[turn_index]), tail) for turns, tail in zip(chains, tails)]
        pack = SegmentPack.forward(executor, segments, keep_state=True)
        picks = [torch.arange(s.tokens.numel()) for s in segments]
        objective = sum(weight * lp.sum() for lp in pack.scored_logprobs(picks))
        for ancestor, adjoint in pack.backward(objective, params=params, sink=None).items():  # type: ignore[arg-type]
            ledgers[ancestor].add(adjoint)
        for s in segments:
            ledgers[s] = AdjointLedger()
        tails, order = segments, [*order, segments]
    for segments in reversed(order):  # trajectory close: replay in reverse turn order, packed
        pack = SegmentPack.forward(executor, segments)
        adjoints = pack.backward(None, [ledgers[s].tensors for s in segments], params=params, sink=None)
        for ancestor, adjoint in adjoints.items():
            ledgers[ancestor].add(adjoint)
    pack = SegmentPack.forward(executor, [root])  # group close
    pack.backward(None, [ledgers[root].tensors], params=params, sink=None)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_turn_by_turn_backward_with_ledger_replay_equals_dense(lora: bool, forms: Acceleration | None = None) -> None:
    model = tiny_qwen3(torch.float64)
    if lora:
        model = with_lora(model)
    reference = copy.deepcopy(model)
    prompt = [5, 9, 2, 7]
    chains = [[[11, 12, 13], [40, 41], [20, 21, 22, 23]], [[14], [42, 43, 44], [24, 25]]]
    _dense(reference, prompt, chains)
    _streamed(model, prompt, chains, forms)
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if q.requires_grad]
    diff = sum(float((a - b).pow(2).sum()) for a, b in pairs) ** 0.5
    norm = sum(float(b.pow(2).sum()) for _, b in pairs) ** 0.5
    assert diff / norm < 1e-10


def test_a_segment_needs_a_forwarded_parent() -> None:
    anatomy = decoder_anatomy(tiny_qwen3())
    with pytest.raises(ValueError, match="parent segment has no K/V state yet"):
        SegmentPack.forward(PackExecutor(anatomy), [Segment(torch.tensor([1]), Segment(torch.tensor([2])))])


@pytest.mark.parametrize("root_in_pack", [True, False], ids=["root-in-pack", "root-by-proxy"])
def test_parents_forwarded_in_the_same_pack_as_their_children_equal_dense(
    root_in_pack: bool, forms: Acceleration | None = None
) -> None:
    """[root, a, b (after a), c (after root)] in one pack: children read in-pack parents' K/V."""
    model = tiny_qwen3(torch.float64)
    reference = copy.deepcopy(model)
    prompt, a, b, c = [5, 9, 2, 7], [11, 12, 13], [40, 41], [20, 21, 22]
    for ids in (prompt + a + b, prompt + c):
        t = torch.tensor(ids)
        logp = reference(input_ids=t[None]).logits[0].log_softmax(-1)[:-1].gather(-1, t[1:, None])[:, 0]
        logp[len(prompt) - 1 :].sum().backward()

    anatomy = decoder_anatomy(model)
    executor = PackExecutor(anatomy, forms)
    params = anatomy.trainable_parameters()
    root = Segment(torch.tensor(prompt))
    if not root_in_pack:
        SegmentPack.forward(executor, [root], grad=False, keep_state=True)
    seg_a = Segment(torch.tensor(a), root)
    segments = [seg_a, Segment(torch.tensor(b), seg_a), Segment(torch.tensor(c), root)]
    if root_in_pack:
        segments.insert(0, root)
    pack = SegmentPack.forward(executor, segments)
    picks = [torch.arange(1 if s is root else 0, s.tokens.numel()) if s is not root else None for s in segments]
    objective = sum(lp.sum() for lp in pack.scored_logprobs(picks))
    adjoints = pack.backward(objective, params=params, sink=None)  # type: ignore[arg-type]
    assert (root in adjoints) != root_in_pack
    if not root_in_pack:
        replay = SegmentPack.forward(executor, [root])
        replay.backward(None, [adjoints[root]], params=params, sink=None)
    diff = sum(float((p.grad - q.grad).pow(2).sum()) for p, q in zip(model.parameters(), reference.parameters()))
    norm = sum(float(q.grad.pow(2).sum()) for q in reference.parameters())
    assert (diff / norm) ** 0.5 < 1e-10
