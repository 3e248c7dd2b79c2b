"""``type = "source"``: emits one PromptSubmitted per task, in logical batches.

Consumes: nothing (a source). Produces: PromptSubmitted. Waits for: backpressure from generate;
with an ``admission``, room for the next group; with ``claims``, each batch's policy.
Unblocked by: generate taking prompts from its inbox, close releasing groups, step publishing
the policy.

The tasks are the file's ``prompts`` (token ids, no fields) or a ``tasks`` runtime object, any
:class:`~thundersync.tasks.TaskSource` (a JSONL file, a dataset, the built-in arithmetic tasks)
or :class:`~thundersync.tasks.TaskStream` (a streaming dataset: read one batch at a time, in a
worker thread, shuffled by the stream itself), whose fields travel on ``PromptSubmitted.task`` to
the reward.

Its data position is the set of batches already consumed (stepped on): a checkpoint records
them and :meth:`SourceStage.skip_batches` makes a resumed source continue after them, with the
same group and batch ids as an uninterrupted run (shuffling is seeded, so the order repeats).

Runtime objects, all optional: ``admission`` (an :class:`~thundersync.scheduling.Admission`):
each group is admitted (its prompt tokens times ``samples``) before its prompt is sent, generate
and tool-execute add its actions' and observations' tokens, and the close stage releases it.
``claims`` (a :class:`~thundersync.scheduling.RankClaims`, given by a data-parallel launch): the
source emits only the groups this rank claims, one claim whenever it has room, after waiting for
the batch's ``policy`` version (a rank that finished its groups early takes more of the next
batch, instead of reserving them while others still work). ``failures`` (an
:class:`~thundersync.scheduling.EpisodeFailures`) under ``on_failure = "drop"`` or
``dynamic_sampling``: after a batch's
prompts the source waits until each of its groups closed; for each group dropped it submits a new
one in the same batch (the next task of a seeded order of its tasks, a new group id), at most the
policy's ``max_refills`` per batch for failed groups; a group dropped by dynamic sampling
(``dynamic_sampling``: its rewards all equal) is refilled the same way, bounded by
``max_oversample`` instead. The next batch's prompts go once the batch is whole.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Annotated, ClassVar

import anyio
import msgspec

from thundersync.errors import ConfigError
from thundersync.events import EventBase, Id, PromptSubmitted, TokenId
from thundersync.pipeline.policy import PolicyClock
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.scheduling import Admission, EpisodeFailures, RankClaims
from thundersync.tasks.data import Task, TaskSource, TaskStream

__all__ = ["SourceStage"]

_TokenIds = list[TokenId]  # bounded like the events that will carry them: [0, 2**31)


class SourceStage(Stage):
    """Submit the tasks ``repeat`` times (epochs), ``groups_per_batch`` groups per batch.

    Each epoch is the task list, shuffled when ``shuffle_seed`` is set (a new order per epoch,
    the same orders on every run with that seed); a task stream gives each epoch's tasks itself,
    shuffled by the seed and the epoch, and needs ``groups_per_batch >= 1``. Group ids count up from 0 over all epochs;
    batch ``b`` holds groups ``b * groups_per_batch ... (b + 1) * groups_per_batch - 1`` (the
    last batch may be smaller; ``groups_per_batch = 0`` puts every group in batch 0). Each prompt
    says how many groups its batch has, so close can seal a batch without waiting for the end of
    the stream. :meth:`limit_batches` (a file's ``[run] steps``) fixes the number of batches
    instead: the epochs then go on as long as needed, whatever ``repeat`` says.
    """

    consumes: ClassVar[tuple[type[EventBase], ...]] = ()
    produces: ClassVar[tuple[type[EventBase], ...]] = (PromptSubmitted,)

    class Config(Stage.Config, frozen=True):
        prompts: list[_TokenIds] = msgspec.field(default_factory=list)
        samples: Annotated[int, msgspec.Meta(ge=1)] = 1
        groups_per_batch: Annotated[int, msgspec.Meta(ge=0)] = 0
        repeat: Annotated[int, msgspec.Meta(ge=1)] = 1  # epochs
        shuffle_seed: int | None = None

        def __post_init__(self) -> None:
            if any(not prompt for prompt in self.prompts):
                raise ConfigError(f"prompts must be non-empty token id lists, got {self.prompts!r}")

    config: Config
    batch_limit: int | None = None
    """How many batches to emit (None: ``repeat`` epochs' worth); see :meth:`limit_batches`."""

    def __init__(
        self,
        config: Config,
        /,
        *,
        tasks: TaskSource | TaskStream | None = None,
        admission: Admission | None = None,
        claims: RankClaims | None = None,
        policy: PolicyClock | None = None,
        failures: EpisodeFailures | None = None,
    ) -> None:
        super().__init__(config)
        self.admission, self.claims, self.policy = admission, claims, policy
        self.failures = failures if failures is not None and failures.drops else None
        if claims is not None and policy is not None and policy.max_staleness:
            raise ConfigError(
                f"the policy clock has max_staleness={policy.max_staleness}, but this source claims groups "
                "across data-parallel ranks, which wait for each batch's own policy; data parallel runs take "
                "max_staleness = 0 (set it on the policy clock)"
            )
        if self.failures is not None and claims is not None:
            raise ConfigError(
                f"{self.failures.dropping} refills groups from one source; data parallel runs take "
                "on_failure = 'zero' and no dynamic_sampling"
            )
        if bool(config.prompts) == (tasks is not None):
            raise ConfigError(
                "a source needs exactly one of prompts (token id lists in the file) and a tasks object "
                f"(a JSONL file, a dataset, the arithmetic tasks); got {'both' if tasks is not None else 'neither'}"
            )
        self._stream = tasks if isinstance(tasks, TaskStream) and not isinstance(tasks, TaskSource) else None
        if self.failures is not None and self._stream is not None:
            raise ConfigError(
                f"{self.failures.dropping} refills dropped groups from a listed task source, not a task "
                "stream (a streaming dataset); use a dataset that is not streamed, or on_failure = 'zero' "
                "and no dynamic_sampling"
            )
        self._tasks: list[Task] = []
        if self._stream is None:
            listed = (
                tasks.tasks() if isinstance(tasks, TaskSource) else [Task(prompt_ids=list(p)) for p in config.prompts]
            )
            if not listed:
                raise ConfigError("the source's tasks object listed no task; give it at least one")
            self._tasks = listed
        elif config.groups_per_batch == 0:
            raise ConfigError(
                "a source over a task stream (a streaming dataset) cannot put every group in one batch: "
                "its length is not known in advance; set groups_per_batch >= 1"
            )
        self.skipped: frozenset[Id] = frozenset()

    def limit_batches(self, batches: int) -> None:
        """Emit exactly ``batches`` full batches (one optimizer step each): the tasks repeat,
        epoch after epoch, as often as needed; ``repeat`` no longer bounds them."""
        if batches < 1:
            raise ConfigError(f"a source must emit at least one batch, got a limit of {batches}")
        self.batch_limit = batches

    def skip_batches(self, batch_ids: Iterable[Id]) -> None:
        """Emit no prompt of these batches (a resumed run's consumed batches)."""
        self.skipped = frozenset(batch_ids)

    @property
    def num_batches(self) -> int | None:
        """How many batches this source emits in all, skipped ones included (None: a task stream
        without a batch limit, whose length shows only as it is read)."""
        groups = self._groups()
        return None if groups is None else -(-groups // self.groups_per_batch)

    @property
    def groups_per_batch(self) -> int:
        """How many groups a full batch holds (with ``groups_per_batch = 0``: all of them)."""
        return self.config.groups_per_batch or len(self._tasks) * self.config.repeat

    def _groups(self) -> int | None:
        """How many groups this source emits in all, skipped ones included (None: not known)."""
        if self.batch_limit is not None:
            return self.batch_limit * self.groups_per_batch
        return None if self._stream is not None else len(self._tasks) * self.config.repeat

    def _ordered(self) -> Iterator[Task]:
        """Every group's task in submission order, epoch after epoch, read lazily."""
        shuffler = None if self.config.shuffle_seed is None else random.Random(self.config.shuffle_seed)
        limit, count = self._groups(), 0
        for epoch in itertools.count():
            if self.batch_limit is None and epoch >= self.config.repeat:
                return
            before = count
            for task in self._epoch(epoch, shuffler):
                if limit is not None and count >= limit:
                    return
                yield task
                count += 1
            if count == before:
                raise ConfigError(f"the source's task stream yielded no task in epoch {epoch}; it needs at least one")

    def _epoch(self, epoch: int, shuffler: random.Random | None) -> Iterator[Task]:
        if self._stream is not None:
            return self._stream.stream(epoch, self.config.shuffle_seed)
        tasks = list(self._tasks)
        if shuffler is not None:
            shuffler.shuffle(tasks)
        return iter(tasks)

    def batches(self) -> Iterator[list[PromptSubmitted]]:
        """The prompts of each batch this source emits, in order, read lazily (skipped batches
        are read and dropped)."""
        per_batch = self.groups_per_batch
        tasks = self._ordered()
        for batch in itertools.count():
            chunk = list(itertools.islice(tasks, per_batch))
            if not chunk:
                return
            if batch in self.skipped:
                continue
            yield [
                PromptSubmitted(
                    group_id=batch * per_batch + offset,
                    prompt_tokens=list(task.prompt_ids),
                    num_trajectories=self.config.samples,
                    batch_id=batch,
                    groups_in_batch=len(chunk),
                    task=dict(task.fields),
                )
                for offset, task in enumerate(chunk)
            ]

    def submissions(self) -> list[PromptSubmitted]:
        """Every prompt this source emits, in order (none of the skipped batches)."""
        return [prompt for batch in self.batches() for prompt in batch]

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        batches = self._read_batches()
        if self.failures is not None:
            await self._refilling(self.failures, batches, outbox)
            return
        if self.claims is None:
            async for batch in batches:
                for event in batch:
                    await self._admit(event)
                    await outbox.send(event)
            return
        try:
            await self._claim_batches(self.claims, batches, outbox)
        finally:
            self.claims.end()

    async def _read_batches(self) -> AsyncIterator[list[PromptSubmitted]]:
        """:meth:`batches`; a stream's are read in a worker thread (a dataset reads files)."""
        batches = self.batches()
        while True:
            batch = next(batches, None) if self._stream is None else await anyio.to_thread.run_sync(next, batches, None)
            if batch is None:
                return
            yield batch

    async def _claim_batches(
        self, claims: RankClaims, batches: AsyncIterator[list[PromptSubmitted]], outbox: Outbox
    ) -> None:
        """Emit the groups this rank claims, batch by batch, each batch on its policy."""
        base = 0 if self.policy is None else self.policy.version
        n = 0
        async for batch in batches:
            prompts = {prompt.group_id: prompt for prompt in batch}
            batch_id = batch[0].batch_id
            if self.policy is not None:
                await self.policy.wait_for(base + n)
            n += 1
            while True:
                if self.admission is not None:
                    await self.admission.wait_for_room()
                group_id = await claims.claim(batch_id, list(prompts))
                if group_id is None:
                    break
                await self._admit(prompts[group_id])
                await outbox.send(prompts[group_id])

    async def _refilling(
        self, failures: EpisodeFailures, batches: AsyncIterator[list[PromptSubmitted]], outbox: Outbox
    ) -> None:
        """Batch by batch: submit its prompts, then a new group for each one dropped, until it is whole."""
        if failures.config.dynamic_sampling and not failures.reward_stages:
            raise ConfigError(
                "dynamic_sampling is on, but no reward stage reports its groups' rewards to this "
                "EpisodeFailures, so no group would ever be dropped: give the reward stage the same "
                "failures= (a pipeline file does), or turn dynamic_sampling off (an agent-app graph's "
                "episodes bring their own rewards and cannot use it)"
            )
        refills = self._refill_tasks()
        next_id = self._groups() or 0  # listed tasks only (checked in __init__): the count is known
        async for prompts in batches:
            batch_id = prompts[0].batch_id
            open_groups = set()
            for prompt in prompts:
                failures.submitted(prompt.group_id, batch_id)
                open_groups.add(prompt.group_id)
                await self._admit(prompt)
                await outbox.send(prompt)
            while open_groups:
                for group_id, dropped in await failures.wait_settled(batch_id):
                    open_groups.discard(group_id)
                    if not dropped:
                        continue
                    failures.refilled(batch_id, group_id)  # raises past max_refills
                    task = next(refills)
                    refill = msgspec.structs.replace(
                        prompts[0], group_id=next_id, prompt_tokens=list(task.prompt_ids), task=dict(task.fields)
                    )
                    next_id += 1
                    failures.submitted(refill.group_id, batch_id)
                    open_groups.add(refill.group_id)
                    await self._admit(refill)
                    await outbox.send(refill)

    def _refill_tasks(self) -> Iterator[Task]:
        """Tasks for refills: the task list over and over, each pass in a new seeded order."""
        draw = random.Random(f"refill/{self.config.shuffle_seed}")
        while True:
            order = list(self._tasks)
            draw.shuffle(order)
            yield from order

    async def _admit(self, prompt: PromptSubmitted) -> None:
        if self.admission is not None:
            tokens = len(prompt.prompt_tokens) * prompt.num_trajectories
            await self.admission.admit_group(prompt.group_id, tokens=tokens)
