"""The GPU work of a GRPO group, run by the engine's worker in submission order.

A group's tensors live in a :class:`GroupWork`: the prompt segment (the root of the group's
forest; its K/V state is computed only when a branch must run before the group closes), the reward-linear pair of parameter accumulators (G1 = sum (r_i - r0) g_i, G2 = sum g_i)
and of prompt-state adjoint ledgers (L1, L2), and the ledger F of adjoints that arrive already
weighted by their final advantage. Only worker jobs touch them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from thundersync.engine import forest
from thundersync.engine.forest import AdjointLedger, Segment, SegmentPack
from thundersync.engine.mismatch import LogprobMismatch
from thundersync.engine.run import StreamingRun
from thundersync.engine.sinks import FlatAccumulator
from thundersync.grpo.losses import ImportanceStats, LossForm
from thundersync.model.packed import KVStack

__all__ = ["Branch", "GroupWork", "backward_final", "backward_linear", "close_group", "forward_prompt"]


@dataclass(eq=False)
class Branch:
    """A trajectory as one chunk after the prompt: all its turns' tokens and scored flags, the
    behaviour log-probs of its scored tokens (NaN where none was given), and its reward once closed."""

    tokens: list[int] = field(default_factory=list)
    scored: list[bool] = field(default_factory=list)
    behaviour: list[float] = field(default_factory=list)
    reward: float | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def add_turn(self, ids: list[int], flags: list[bool], behaviour: torch.Tensor | None) -> None:
        """Append a turn; ``behaviour``: one log-prob per scored token of the turn, or None."""
        if behaviour is not None or self.behaviour:  # keep the list aligned with the scored tokens
            unknown = sum(self.scored) - len(self.behaviour) + (sum(flags) if behaviour is None else 0)
            self.behaviour += [math.nan] * unknown + ([] if behaviour is None else behaviour.tolist())
        self.tokens += ids
        self.scored += flags


@dataclass(eq=False)
class GroupWork:
    """A group's tensors (module docstring); ``cancelled`` once its rewards are all equal;
    ``mismatch``: where its branches' forwards report their behaviour/learner log-prob gaps;
    ``form``: the loss form of :mod:`thundersync.grpo.losses` (None: plain GRPO, ``lp.sum() * A``);
    ``early``: the importance weights of branches forwarded before the close, counted in the form's
    statistics only when the group contributes (not when its rewards turn out all equal or it is dropped)."""

    prompt: list[int]
    mismatch: LogprobMismatch = field(default_factory=LogprobMismatch)
    form: LossForm | None = None
    root: Segment | None = None
    g1: FlatAccumulator | None = None
    g2: FlatAccumulator | None = None
    l1: AdjointLedger = field(default_factory=AdjointLedger)
    l2: AdjointLedger = field(default_factory=AdjointLedger)
    final: AdjointLedger = field(default_factory=AdjointLedger)
    cancelled: bool = False
    early: ImportanceStats = field(default_factory=ImportanceStats)  # the linear path's, counted at the close

    def nbytes(self) -> int:
        state = 0 if self.root is None or self.root.state is None else self.root.state.nbytes
        accs = sum(a.nbytes() for a in (self.g1, self.g2) if a is not None)
        return state + accs + self.l1.nbytes() + self.l2.nbytes() + self.final.nbytes()

    def release(self) -> None:
        self.root = None
        self.g1 = self.g2 = None
        self.l1, self.l2, self.final = AdjointLedger(), AdjointLedger(), AdjointLedger()


def forward_prompt(run: StreamingRun, work: GroupWork) -> None:
    """Compute the prompt's K/V state once (no graph); branches read it through a proxy."""
    work.root = forest.forward_prompt(run.executor, run.tensor(work.prompt))


def _forward_branches(
    run: StreamingRun,
    roots: Sequence[Segment],
    branches: Sequence[Branch],
    mismatch: LogprobMismatch,
    prompt: Segment | None = None,
) -> tuple[SegmentPack, list[torch.Tensor]]:
    """Forward branches (after ``prompt`` in the same pack when given); their scored log-probs,
    whose gaps to the branches' behaviour log-probs go to ``mismatch``."""
    ids = run.tensor([t for b in branches for t in b.tokens])  # one copy for the pack
    segments = [Segment(t, root) for root, t in zip(roots, torch.split(ids, [len(b) for b in branches]))]
    head = [prompt] if prompt is not None else []
    pack = SegmentPack.forward(run.executor, [*head, *segments])
    picks = [[j for j, s in enumerate(b.scored) if s] for b in branches]
    logprobs = pack.scored_logprobs([*([None] * len(head)), *picks])[len(head) :]
    known = [(lp, b.behaviour) for b, lp in zip(branches, logprobs) if b.behaviour]
    if known:  # one comparison for the pack
        learner = torch.cat([lp for lp, _ in known])
        mismatch.add(learner, torch.tensor([x for _, behaviour in known for x in behaviour], dtype=torch.float64))
    return pack, logprobs


def backward_linear(run: StreamingRun, work: GroupWork, branches: Sequence[Branch], delta: float) -> None:
    """Branches of one open group sharing the reward r = r0 + delta: G2 += g, G1 += delta * g."""
    if work.cancelled or work.root is None:
        return
    pack, logprobs = _forward_branches(run, [work.root] * len(branches), branches, work.mismatch)
    if work.form is None:
        objective = torch.stack([lp.sum() for lp in logprobs]).sum()
    else:  # a linear form (no KL): J_i / A_i
        terms = [work.form.objective(lp, b.behaviour, 1.0, into=work.early) for b, lp in zip(branches, logprobs)]
        objective = torch.stack(terms).sum()
    adjoints = pack.backward(objective, params=run.params, sink=run.capture)
    if work.g2 is None:
        work.g1, work.g2 = run.new_accumulator(), run.new_accumulator()
    assert work.g1 is not None
    work.g2.add_scratch(run.capture)
    work.g1.add_scratch(run.capture, delta)
    adjoint = adjoints.get(work.root)
    if adjoint is not None:
        work.l2.add(adjoint)
        work.l1.add(adjoint, delta)


def backward_final(run: StreamingRun, items: Sequence[tuple[GroupWork, Branch, float]]) -> None:
    """Branches of closed groups, each weighted by its advantage, straight into the run's total."""
    live = [(w, w.root, b, a) for w, b, a in items if not w.cancelled and w.root is not None]
    if not live:
        return
    roots, branches = [root for _, root, _, _ in live], [b for _, _, b, _ in live]
    pack, logprobs = _forward_branches(run, roots, branches, live[0][0].mismatch)
    refs = _references([(w, b) for w, _, b, _ in live])
    terms = [_term(w, b, lp, a, ref) for (w, _, b, a), lp, ref in zip(live, logprobs, refs)]
    objective = torch.stack(terms).sum()
    adjoints = pack.backward(objective, params=run.params, sink=run.capture)
    run.total.add_scratch(run.capture)
    for work, root in {id(w): (w, root) for w, root, _, _ in live}.values():
        adjoint = adjoints.get(root)
        if adjoint is not None:
            work.final.add(adjoint)


def _term(
    work: GroupWork, branch: Branch, lp: torch.Tensor, advantage: float, reference: list[float] | None
) -> torch.Tensor:
    """J_i of one branch with its final advantage: ``lp.sum() * A`` for plain GRPO."""
    if work.form is None:
        return lp.sum() * advantage
    return work.form.objective(lp, branch.behaviour, advantage, reference=reference)


def _references(items: Sequence[tuple[GroupWork, Branch]]) -> list[list[float] | None]:
    """The reference log-probs of each branch's scored tokens when its form has a KL term (one
    packed scorer call per group of the pack), else None."""
    out: list[list[float] | None] = [None] * len(items)
    by_group: dict[int, list[int]] = {}
    for index, (work, _) in enumerate(items):
        if work.form is not None and work.form.has_kl:
            by_group.setdefault(id(work), []).append(index)
    for indices in by_group.values():
        form, prompt = items[indices[0]][0].form, items[indices[0]][0].prompt
        assert form is not None
        scored = form.reference_logprobs(prompt, [(items[i][1].tokens, items[i][1].scored) for i in indices])
        for i, values in zip(indices, scored):
            out[i] = values
    return out


def _combined_adjoint(work: GroupWork, c1: float, c2: float) -> KVStack | None:
    combined = AdjointLedger()
    for ledger, scale in ((work.l1, c1), (work.l2, c2), (work.final, 1.0)):
        if ledger.tensors is not None:
            combined.add(ledger.tensors, scale)
    return combined.tensors


def close_group(
    run: StreamingRun, work: GroupWork, last: Sequence[tuple[GroupWork, Branch, float]], c1: float, c2: float
) -> None:
    """The group's last pack: the prompt forwarded together with its ``last`` waiting branches.

    The total receives c1 G1 + c2 G2; then one backward of ``sum_i A_i S_i`` over ``last`` plus
    the prompt's combined adjoint c1 L1 + c2 L2 + F for its K/V outputs (the branches of the
    pack reach the prompt through the graph, the earlier ones through that adjoint).
    """
    if work.cancelled:
        work.release()
        return
    if work.form is not None:  # its early branches' weights count now that the group contributes
        work.form.stats.merge(work.early)
    if work.g1 is not None and work.g2 is not None:
        run.total.add_combination([(c1, work.g1), (c2, work.g2)])
    adjoint = _combined_adjoint(work, c1, c2)
    if adjoint is None and not last:
        work.release()
        return
    root = Segment(run.tensor(work.prompt))
    pack, logprobs = _forward_branches(run, [root] * len(last), [b for _, b, _ in last], work.mismatch, prompt=root)
    refs = _references([(work, b) for _, b, _ in last])
    terms = [_term(work, b, lp, a, ref) for (_, b, a), lp, ref in zip(last, logprobs, refs)]
    objective = torch.stack(terms).sum() if terms else None
    kv_adjoints = [adjoint] + [None] * len(last)
    pack.backward(objective, kv_adjoints, params=run.params, sink=run.capture)
    run.total.add_scratch(run.capture)
    work.release()
