"""``type = "source"``: emits one PromptSubmitted per configured prompt, in logical batches.

Consumes: nothing (a source). Produces: PromptSubmitted. Waits for: nothing but backpressure
from generate. Unblocked by: generate taking prompts from its inbox.

Its data position is the set of batches already consumed (stepped on): a checkpoint records
them and :meth:`SourceStage.skip_batches` makes a resumed source continue after them, with the
same group and batch ids as an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, ClassVar

import msgspec

from thundersync.errors import ConfigError
from thundersync.events import EventBase, Id, PromptSubmitted
from thundersync.pipeline.stage import Inbox, Outbox, Stage

__all__ = ["SourceStage"]

_TokenIds = list[Annotated[int, msgspec.Meta(ge=0)]]


class SourceStage(Stage):
    """Submit ``prompts`` (token ids), ``repeat`` times, ``groups_per_batch`` groups per batch.

    Group ids count up from 0 over all repeats; batch ``b`` holds groups
    ``b * groups_per_batch ... (b + 1) * groups_per_batch - 1`` (the last batch may be smaller;
    ``groups_per_batch = 0`` puts every group in batch 0). Each prompt says how many groups its
    batch has, so close can seal a batch without waiting for the end of the stream.
    """

    consumes: ClassVar[tuple[type[EventBase], ...]] = ()
    produces: ClassVar[tuple[type[EventBase], ...]] = (PromptSubmitted,)

    class Config(Stage.Config, frozen=True):
        prompts: list[_TokenIds]
        samples: Annotated[int, msgspec.Meta(ge=1)] = 1
        groups_per_batch: Annotated[int, msgspec.Meta(ge=0)] = 0
        repeat: Annotated[int, msgspec.Meta(ge=1)] = 1

        def __post_init__(self) -> None:
            if not self.prompts or any(not prompt for prompt in self.prompts):
                raise ConfigError(f"prompts must be a non-empty list of non-empty token id lists, got {self.prompts!r}")

    config: Config

    def __init__(self, config: Config, /) -> None:
        super().__init__(config)
        self.skipped: frozenset[Id] = frozenset()

    def skip_batches(self, batch_ids: Iterable[Id]) -> None:
        """Emit no prompt of these batches (a resumed run's consumed batches)."""
        self.skipped = frozenset(batch_ids)

    @property
    def num_batches(self) -> int:
        """How many batches this source emits in all, skipped ones included."""
        groups = len(self.config.prompts) * self.config.repeat
        per_batch = self.config.groups_per_batch or groups
        return -(-groups // per_batch)

    def submissions(self) -> list[PromptSubmitted]:
        """Every prompt this source emits, in order (none of the skipped batches)."""
        prompts = self.config.prompts * self.config.repeat
        per_batch = self.config.groups_per_batch or len(prompts)
        out = []
        for index, prompt in enumerate(prompts):
            batch = index // per_batch
            if batch in self.skipped:
                continue
            size = min(per_batch, len(prompts) - batch * per_batch)
            out.append(
                PromptSubmitted(
                    group_id=index,
                    prompt_tokens=list(prompt),
                    num_trajectories=self.config.samples,
                    batch_id=batch,
                    groups_in_batch=size,
                )
            )
        return out

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        for event in self.submissions():
            await outbox.send(event)
