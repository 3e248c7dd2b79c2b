"""Streaming backward execution: the model adapter, the causal segment forest and the run.

``anatomy`` finds the decoder's submodules, ``adapter`` runs them over packed chunks after a
detached prefix state; the segment core and :class:`StreamingRun` build on them.
"""

from __future__ import annotations

__all__: list[str] = []
