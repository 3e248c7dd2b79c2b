"""What a pipeline file's ``[run.split]`` may say, checked when the file is read (no torch).

A split (decision 088) runs a single-turn GRPO or OPD graph: exactly one stage of each of the
types ``source``, ``generate``, ``reward``, ``backward``, ``close`` and ``step``, and for OPD one
``teacher-score`` stage (decision 094). The rollout ranks run the first three (the source's
batches, the generate stage's sampling settings and the reward stage's scorer), the learner ranks
the teacher stage's teacher and the last three (the backward stage's objective, the step stage's
trainer, policy clock and checkpointer; several learner ranks form one learner, sharded with
``[run] shard = true``, else replicated: decision 090). :func:`check_split` refuses, naming the key,
the value and what to do: a placement that is not every rank ``0 .. N-1`` once in one role,
learner ranks not in increasing order, and what the split does not run: ``max_staleness`` > 0, an
``[eval]``, another stage type (tools, agent apps), a second teacher stage, several turns, a
reward's ``overlong`` other than ``keep``, an objective in a learner process, an optimizer's
``shard_state``, an ``admission``, ``episode-failures`` or ``openai-generator`` object. :func:`check_world` compares the
placement with the launch's size. That a teacher stage comes with an OPD objective (and GRPO's
without one) is checked when the objects are built (:func:`thundersync.app.cli.split.split_parts`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from thundersync.errors import ConfigError, DefinitionError

__all__ = ["SPLIT_STAGES", "SplitSettings", "check_split", "check_world"]

SPLIT_STAGES = ("source", "generate", "reward", "backward", "close", "step")
"""The stage types of a graph a split runs, one stage of each."""
TEACHER_STAGES = ("teacher-score", "teacher")
"""The teacher stage's type (``teacher``: its old name): an OPD split's one more stage."""


class SplitSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``[run.split]``: a rollout/learner split under a multi-process launch (``torchrun``).

    ``rollout``: the ranks that generate; ``learner``: the ranks that learn, in increasing order
    (the first writes the files; several shard the model with ``[run] shard = true``). Together
    they name every rank of the launch once (``0 .. N-1`` for ``--nproc-per-node N``), checked
    when the file is read (:func:`check_split`, with what the split does not support) and when the
    run starts (:func:`check_world`, against ``WORLD_SIZE``). :mod:`thundersync.app.cli.split`
    runs it; decision 088.
    """

    rollout: list[int]
    learner: list[int]


_NOT_OBJECTS = {
    "admission": "each rollout rank starts its whole share of a batch at once, so an admission bounds nothing",
    "episode-failures": "the split has no failure policy (no drop, no dynamic sampling)",
    "openai-generator": (
        "the learner's weights reach each rollout rank's own model, which a torch-generator samples from and a "
        "vllm-generator's in-process engine is made to serve; an OpenAI server's weights are out of the broadcast's "
        "reach: use a torch-generator or a vllm-generator"
    ),
}


def check_split(spec: Any) -> None:
    """Refuse a ``[run.split]`` the split cannot run (module docstring); no split: nothing to check.
    ``spec``: a :class:`~thundersync.app.files.definition.PipelineSpec` (not imported: it imports this module)."""
    split = spec.run.split
    if split is None:
        return
    _check_placement(split)
    _check_run(spec)
    _check_stages(spec)
    _check_objects(spec)


def check_world(split: SplitSettings, world_size: int | None) -> None:
    """Refuse a placement whose ranks are not the launch's (``world_size``; None: not launched)."""
    count = len(split.rollout) + len(split.learner)
    if world_size is None:
        raise ConfigError(
            f"run.split places {count} ranks (rollout {split.rollout}, learner {split.learner}), but this is one "
            f"process; launch it with torchrun --nproc-per-node {count} -m thundersync run FILE, or drop [run.split]"
        )
    if world_size != count:
        raise ConfigError(
            f"run.split places {count} ranks (rollout {split.rollout}, learner {split.learner}), but the launch has "
            f"{world_size} (WORLD_SIZE); launch {count} processes (--nproc-per-node {count}) or place {world_size} ranks"
        )


def _check_placement(split: SplitSettings) -> None:
    for key, ranks in (("rollout", split.rollout), ("learner", split.learner)):
        if not ranks:
            raise DefinitionError(f"run.split.{key}: is empty; a split needs at least one {key} rank")
        negative = [rank for rank in ranks if rank < 0]
        if negative:
            raise DefinitionError(f"run.split.{key}: ranks are >= 0, got {negative[0]} in {ranks}")
    named = Counter([*split.rollout, *split.learner])
    twice = sorted(rank for rank, n in named.items() if n > 1)
    if twice:
        where = "both roles" if set(twice) & set(split.rollout) & set(split.learner) else "one role twice"
        raise DefinitionError(
            f"run.split: rank {twice[0]} is named in {where} (rollout {split.rollout}, learner {split.learner}); "
            "name every rank once, in one role"
        )
    if split.learner != sorted(split.learner):
        raise DefinitionError(
            f"run.split.learner: {split.learner} is not in increasing order; the first learner rank writes the "
            "files and is rank 0 of the learners' group (a sharded checkpoint's writer): list them as "
            f"{sorted(split.learner)}"
        )
    beyond = sorted(rank for rank in named if rank >= len(named))
    if beyond:
        raise DefinitionError(
            f"run.split: rank {beyond[0]} is not a rank of {len(named)} processes (0..{len(named) - 1}; rollout "
            f"{split.rollout}, learner {split.learner}); name the ranks 0..N-1 of N processes, each once"
        )  # distinct ranks, none >= N: every rank 0..N-1 is named


def _check_run(spec: Any) -> None:
    run = spec.run
    if run.max_staleness:
        raise DefinitionError(
            f"run.max_staleness: {run.max_staleness}; a split generates each batch on the learner's newest "
            "weights (the learner refuses older ones): set max_staleness = 0, or drop [run.split]"
        )
    if spec.eval is not None:
        raise DefinitionError(
            "eval: a split run does not evaluate (not built); drop [eval] from the split's file and run "
            "thundersync eval FILE --checkpoint DIR on its checkpoints"
        )


def _check_stages(spec: Any) -> None:
    for name, stage in spec.stages.items():
        if stage.type not in (*SPLIT_STAGES, *TEACHER_STAGES):
            raise DefinitionError(
                f"stages.{name}.type: {stage.type!r} in a file with [run.split]; the split does not run it. A split "
                f"runs one stage of each of {', '.join(SPLIT_STAGES)} (and for OPD one teacher-score stage): drop "
                "the stage, or drop [run.split]"
            )
    teachers = [name for name, stage in spec.stages.items() if stage.type in TEACHER_STAGES]
    if len(teachers) > 1:
        raise DefinitionError(
            f"run.split: the file has {len(teachers)} teacher stages ({', '.join(teachers)}); an OPD split's "
            "learner ranks score each trajectory with one teacher: keep one teacher-score stage"
        )
    kinds = Counter(stage.type for stage in spec.stages.values())
    for kind in SPLIT_STAGES:
        if kinds[kind] != 1:
            raise DefinitionError(
                f"run.split: the file has {kinds[kind]} stages of type {kind!r}; a split runs one stage of each of "
                f"{', '.join(SPLIT_STAGES)}"
            )
    for name, stage in spec.stages.items():
        config: Any = stage.config
        if stage.type == "generate" and config is not None and config.turns != 1:
            raise DefinitionError(
                f"stages.{name}.turns: {config.turns}; a split samples one action per trajectory: set turns = 1"
            )
        if stage.type == "reward" and config is not None and config.overlong != "keep":
            raise DefinitionError(
                f"stages.{name}.overlong: {config.overlong!r}; a split sends each trajectory's reward as the "
                'scorer gave it: set overlong = "keep"'
            )


def _check_objects(spec: Any) -> None:
    for name, obj in spec.objects.items():
        if obj.factory in _NOT_OBJECTS:
            raise DefinitionError(
                f"objects.{name}.factory: {obj.factory!r} in a file with [run.split]; {_NOT_OBJECTS[obj.factory]}: "
                "remove the object"
            )
        if obj.factory == "policy-clock" and obj.args.get("max_staleness"):
            raise DefinitionError(
                f"objects.{name}.max_staleness: {obj.args['max_staleness']}; a split generates each batch on the "
                "learner's newest weights: set max_staleness = 0, or drop [run.split]"
            )
        if obj.factory == "optimizer" and obj.args.get("shard_state"):
            raise DefinitionError(
                f"objects.{name}.shard_state: true; ZeRO-1 would split the optimizer's state over every rank of the "
                "launch, rollout ranks included: drop shard_state (with several learner ranks, [run] shard = true "
                "shards the model and its optimizer's state over the learners)"
            )
        if obj.factory in ("grpo", "opd") and obj.args.get("process"):
            raise DefinitionError(
                f"objects.{name}.process: true; the split's learner streams into the objective in its own process "
                "(a learner process is not built for the split): set process = false"
            )
