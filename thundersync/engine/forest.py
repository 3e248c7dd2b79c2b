"""The causal segment forest: the core that GRPO and OPD objectives are built on.

A :class:`Segment` is a run of tokens appended after its parent segment (``None`` for a root,
e.g. a prompt). A group is a tree: the prompt is the root, each trajectory a chain below it.
Once forwarded, a segment keeps its K/V ``state`` (detached, model dtype, every layer's in one
:data:`~thundersync.model.packed.KVStack` [layers, 2, Hkv, T, D]), which its descendants read
as a prefix.

:meth:`SegmentPack.forward` runs several segments packed into one row, each after a detached
proxy of its ancestors' states (the proxy is one fp32 / fp64 leaf per chain, the states
concatenated; every chunk reads its own cast of it). Log-probabilities of a segment's token ``j`` come from the hidden state of the token
before it, so a non-root segment is fed as ``[last token of its parent] + its tokens`` and reads
its ancestors' states for every position but that last one: the boundary token's K/V is
recomputed inside the segment (the same values), so its first token is scored exactly and no
hidden-state adjoint has to cross a segment boundary. Only K/V adjoints do. An ancestor may
instead be forwarded in the same pack, before its descendants: they then read its K/V through
the graph (e.g. a prompt packed with its last branches, backpropagated once for all of them).

:meth:`SegmentPack.backward` takes a scalar objective over the scored log-probs and/or adjoints
for the segments' own K/V outputs, sends the parameter gradients to a sink (:mod:`~thundersync.engine.sinks`: a
:class:`~thundersync.engine.sinks.GradCapture` scratch, a
:class:`~thundersync.engine.sinks.GradSum`, or ``p.grad`` directly when the sink is ``None``) and
returns the adjoint of every ancestor's state (a KVStack in the accumulation dtype, full ancestor
length), ready for an :class:`AdjointLedger`. Recomputing a segment later (a replay) gives the
same forward: the engine runs no dropout. How a pack runs is its
:class:`~thundersync.engine.executor.PackExecutor`'s choice; differentiate a pack through
:meth:`SegmentPack.backward` only (a pack the executor replayed from CUDA graphs adds its
parameters' gradients inside its backward, so ``torch.autograd.grad`` over its outputs would not
return them).

Example: on-policy distillation of one trajectory (prompt, scored action, observation, action)::

    root = forward_prompt(executor, prompt_ids)                            # root.state, no graph
    a1 = Segment(action_ids, parent=root)
    pack = SegmentPack.forward(executor, [a1], keep_state=True)
    lp = pack.scored_logprobs([scored_index])[0]                            # fp32 [S]
    adjoints = pack.backward(loss_of(lp), params=params, sink=None)         # grads -> p.grad
    ledgers[root].add(adjoints[root])                                       # later turns add too
    ...                                                                     # o1, a2 likewise
    for seg in reversed([a1, o1, a2]):                                      # trajectory close
        pack = SegmentPack.forward(executor, [seg])                         # recompute
        adjoints = pack.backward(None, [ledgers[seg].tensors], params=params, sink=None)
        for ancestor, adjoint in adjoints.items():
            ledgers[ancestor].add(adjoint)
    # group close: the same replay for the root, once, with ledgers[root]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from thundersync._device import upload
from thundersync.engine.executor import Execution, PackExecutor
from thundersync.engine.sinks import GradCapture, GradSum, accumulate_dtype
from thundersync.model.anatomy import DecoderAnatomy
from thundersync.model.packed import KV, ChunkSpec, KVStack, empty_prefix, head_logprobs

__all__ = ["AdjointLedger", "Segment", "SegmentPack", "forward_prompt"]


class Segment:
    """Tokens [T] (long, on the model's device) that follow ``parent``; positions start at parent.end."""

    def __init__(self, tokens: torch.Tensor, parent: Segment | None = None) -> None:
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"a segment needs a non-empty 1-D token tensor, got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.parent = parent
        self.start = parent.end if parent is not None else 0
        self.state: KVStack | None = None

    @property
    def end(self) -> int:
        return self.start + int(self.tokens.numel())

    def chain(self) -> list[Segment]:
        """The ancestors of this segment, root first (the segment itself excluded)."""
        out: list[Segment] = []
        node = self.parent
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def release(self) -> None:
        """Drop the K/V state (after the last descendant has read it)."""
        self.state = None


class AdjointLedger:
    """The fp32 (fp64) adjoint of one segment's K/V state (a KVStack); allocated on first add."""

    def __init__(self) -> None:
        self.tensors: KVStack | None = None

    def add(self, adjoint: KVStack, scale: float = 1.0) -> None:
        """ledger += scale * adjoint (product rounded first, then the sum)."""
        if scale == 0.0:
            return
        scaled = adjoint * scale if scale != 1.0 else adjoint
        if self.tensors is None:
            self.tensors = scaled.clone() if scaled is adjoint else scaled
        else:
            self.tensors.add_(scaled)

    def nbytes(self) -> int:
        return 0 if self.tensors is None else self.tensors.numel() * self.tensors.element_size()


class SegmentPack:
    """Segments forwarded together; holds the graph until :meth:`backward` (then drop the pack)."""

    def __init__(
        self,
        anatomy: DecoderAnatomy,
        segments: Sequence[Segment],
        execution: Execution,
        leaves: dict[int, tuple[list[Segment], KVStack]],
    ) -> None:
        self.anatomy = anatomy
        self.segments = list(segments)
        self.execution: Execution | None = execution
        self.output = execution.output
        self._leaves = leaves  # id(parent) -> (its chain incl. the parent, the proxy leaf)

    @classmethod
    def forward(
        cls,
        executor: PackExecutor,
        segments: Sequence[Segment],
        *,
        grad: bool = True,
        keep_state: bool = False,
        accumulate: bool = False,
    ) -> SegmentPack:
        """Forward ``segments`` packed; with ``keep_state`` each keeps its own K/V as ``state``.
        ``accumulate``: the backward's sink will be a :class:`~thundersync.engine.sinks.GradSum`."""
        anatomy = executor.anatomy
        leaves: dict[int, tuple[list[Segment], KVStack]] = {}
        index = {id(seg): i for i, seg in enumerate(segments)}
        with torch.enable_grad() if grad else torch.no_grad():
            chunks = [_chunk(anatomy, seg, index, leaves, grad) for seg in segments]
            execution = executor.forward(chunks, grad=grad, accumulate=accumulate)
        pack = cls(anatomy, segments, execution, leaves)
        if keep_state:
            for position, seg in enumerate(segments):
                seg.state = execution.output.state(position, skip=0 if seg.parent is None else 1)
        return pack

    def kv(self, index: int) -> list[KV]:
        """Segment ``index``'s own per-layer (k, v) [Hkv, T, D], with graph (boundary token dropped)."""
        seg = self.segments[index]
        skip = 0 if seg.parent is None else 1
        return [(k[:, skip:], v[:, skip:]) for k, v in self.output.kv(index)]

    def scored_logprobs(
        self,
        selections: Sequence[Sequence[int] | torch.Tensor | None],
        head_grad_into: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """Per segment, log pi(token j | everything before it) for the own-token indices given.

        ``selections[i]``: indices into segment i's tokens, ints or a long tensor (best on the
        host: a device tensor is read back), ``None`` for none. A root's token 0 has no context and
        cannot be selected. One index copy and one fused head call for the whole pack.
        ``head_grad_into``: see :func:`~thundersync.model.packed.head_logprobs`.
        """
        rows: list[int] = []
        sizes = []
        for index, (seg, picked) in enumerate(zip(self.segments, selections)):
            ids = [] if picked is None else picked.tolist() if isinstance(picked, torch.Tensor) else picked
            base = self.output.offsets[index] - (1 if seg.parent is None else 0)  # the row before token 0
            rows += [base + j for j in ids]
            sizes.append(len(ids))
        if not rows:
            empty = self.output.hidden.new_zeros(0, dtype=accumulate_dtype(self.output.hidden.dtype))
            return [empty for _ in sizes]
        at = upload(torch.tensor(rows, dtype=torch.long), self.output.hidden.device)
        # row r predicts r + 1
        lp = head_logprobs(self.anatomy, self.output.hidden[at], self.output.tokens[at + 1], head_grad_into)
        return list(torch.split(lp, sizes))

    def backward(
        self,
        objective: torch.Tensor | None,
        kv_adjoints: Sequence[KVStack | None] | None = None,
        *,
        params: Sequence[torch.nn.Parameter],
        sink: GradCapture | GradSum | None,
    ) -> dict[Segment, KVStack]:
        """Backpropagate ``objective`` (a scalar) and/or adjoints of the segments' own K/V.

        Parameter gradients go to ``sink`` (``p.grad`` when ``None``; a pack forwarded with
        ``accumulate`` takes a :class:`~thundersync.engine.sinks.GradSum`); returns each
        ancestor's state adjoint (accumulation dtype, full length: the direct parent's last
        position, recomputed inside the child, gets zero).
        """
        outputs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if objective is not None and objective.requires_grad:
            outputs.append(objective)
            grads.append(torch.ones_like(objective))
        for index, adjoint in enumerate(kv_adjoints or []):
            if adjoint is not None:
                adjoint = adjoint.to(self.output.layer_kv[0][0].dtype)  # one cast for every layer
                for (k, v), (ak, av) in zip(self.kv(index), adjoint):
                    for out, adj in ((k, ak), (v, av)):
                        if out.requires_grad:  # e.g. layer-0 keys under LoRA on q/v only: no graph
                            outputs.append(out)
                            grads.append(adj)
        execution = self.execution
        assert execution is not None, "a pack is backpropagated once"
        leaves = [leaf for _, leaf in self._leaves.values()] + execution.inputs
        summed = execution.summed and isinstance(sink, GradSum)
        if summed:
            # The replay adds its parameters' gradients to the graph totals itself: autograd
            # reaches only those the objective uses outside it (the head's, unless the head adds
            # its own), and the K/V outputs reach the replay alone.
            reached = _leaves_reached(outputs[:1] if objective is not None and objective.requires_grad else [])
            params = [p for p in params if id(p) in reached]
        if outputs:
            capture: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            if sink is not None:
                capture = sink.capture(summed, params) if isinstance(sink, GradSum) else sink.capture()
            with capture:
                torch.autograd.backward(outputs, grads, inputs=[*params, *leaves])
        result = self._ancestor_adjoints()
        self.output = None  # type: ignore[assignment]  # free the activations now
        self._leaves = {}
        self._release()
        return result

    def _release(self) -> None:
        if self.execution is not None:
            self.execution.release()
            self.execution = None

    def __del__(self) -> None:
        self._release()  # a pack dropped without its backward frees its graphs' buffers too

    def _ancestor_adjoints(self) -> dict[Segment, KVStack]:
        result: dict[Segment, KVStack] = {}
        for chain, leaf in self._leaves.values():
            lengths = [int(a.tokens.numel()) for a in chain]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for ancestor, piece in zip(chain, torch.split(grad, lengths, dim=3)):
                if ancestor in result:
                    result[ancestor].add_(piece)
                else:  # a view of the leaf's gradient: the pack drops its leaves, nothing else reads it
                    result[ancestor] = piece
        return result


def _leaves_reached(outputs: Sequence[torch.Tensor]) -> set[int]:
    """The ids of the leaves a backward from ``outputs`` accumulates into (its ``AccumulateGrad`` nodes')."""
    found: set[int] = set()
    seen: set[object] = set()
    stack = [o.grad_fn for o in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found.add(id(node.variable))
        else:
            stack.extend(n for n, _ in node.next_functions)
    return found


def forward_prompt(executor: PackExecutor, tokens: torch.Tensor) -> Segment:
    """A group's prompt as a root segment with its K/V ``state`` computed (no graph): the shared
    prefix that the group's trajectories read through proxies."""
    root = Segment(tokens)
    SegmentPack.forward(executor, [root], grad=False, keep_state=True)
    return root


def _proxy(
    anatomy: DecoderAnatomy, chain: list[Segment], leaves: dict[int, tuple[list[Segment], KVStack]], grad: bool
) -> KVStack:
    """An fp32 (fp64) leaf holding the concatenated states of ``chain`` (shared per pack)."""
    key = id(chain[-1])
    if key not in leaves:
        states = [a.state for a in chain if a.state is not None]
        if len(states) < len(chain):
            raise ValueError(
                "the parent segment has no K/V state yet: forward it with keep_state=True first, "
                "or in the same pack before its children"
            )
        shape = list(states[0].shape)
        shape[3] = sum(int(s.shape[3]) for s in states)
        joined = states[0].new_empty(shape, dtype=accumulate_dtype(anatomy.dtype))
        torch.cat(states, dim=3, out=joined)  # cast while concatenated: one pass
        leaves[key] = (chain, joined.requires_grad_(grad))
    return leaves[key][1]


def _chunk(
    anatomy: DecoderAnatomy,
    seg: Segment,
    index: dict[int, int],
    leaves: dict[int, tuple[list[Segment], KVStack]],
    grad: bool,
) -> ChunkSpec:
    if seg.parent is None:
        return ChunkSpec(seg.tokens, 0, empty_prefix(anatomy, seg.tokens.device))
    chain = [*seg.parent.chain(), seg.parent]
    position = index[id(seg)]
    packed = [index.get(id(a), position) < position for a in chain]  # forwarded earlier in this pack
    first = packed.index(True) if any(packed) else len(chain)
    if not all(packed[first:]):
        raise ValueError("a segment's ancestors in the same pack must be the lowest ones of its chain")
    above, inside = chain[:first], chain[first:]
    prefix, prefix_len = empty_prefix(anatomy, seg.tokens.device), None
    if above:
        prefix = _proxy(anatomy, above, leaves, grad)  # read as it is: the pack casts it once per layer
        prefix_len = None if inside else seg.parent.end - 1  # the parent's last token is recomputed in the chunk
    in_pack = tuple((index[id(a)], 0 if a.parent is None else 1, 1 if a is seg.parent else 0) for a in inside)
    tokens = torch.cat([seg.parent.tokens[-1:], seg.tokens])
    return ChunkSpec(tokens, seg.start - 1, prefix, in_pack=in_pack, prefix_len=prefix_len)
