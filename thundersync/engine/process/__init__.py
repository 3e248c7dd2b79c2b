"""The learner in a process of its own, over its parent's parameters: no copy, proved once at start.

In one process the engine's worker thread, the generator's loop and the event loop share one GIL,
so the learner's host work waits for the rollout's and the other way round (bench/RESULTS.md,
section "2026-12-02 — Where the streamed step's time goes: a host timeline, a priority stream, the
teacher (sixth session)"). :class:`LearnerProcess` is a streaming objective whose work runs in a
child: the child holds its own :class:`~thundersync.StreamingRun` and the objective, the parent
everything else, so it drops in wherever an objective goes and the update is the one-process
update, bit for bit.

- :mod:`~.sharing`: the mechanism, :class:`ModelProcess` (spawn, zero-copy sharing, the proof);
- :mod:`~.messages`: every message between the processes, as typed structs;
- :mod:`~.proxy`: the parent's side, :class:`LearnerProcess`;
- :mod:`~.child`: the child's side, one handler per command over its run and objective.
"""

from __future__ import annotations

from thundersync.engine.process.proxy import LearnerProcess, rebuilt
from thundersync.engine.process.sharing import ModelProcess

__all__ = ["LearnerProcess", "ModelProcess", "rebuilt"]
