"""`require_objective`: the check that the backward stage and the trainer share on their objective."""

from __future__ import annotations

from thundersync.errors import ConfigError

__all__ = ["require_objective"]


def require_objective(objective: object, owner: str) -> None:
    """Raise :class:`ConfigError` unless ``objective`` implements the streaming-objective contract.

    The contract is imported here, when a stage or trainer is built (an objective exists then, so
    torch is loaded anyway), so that ``import thundersync.stages`` stays torch-free.
    """
    from thundersync.engine.objective import StreamingObjective

    if not isinstance(objective, StreamingObjective):
        raise ConfigError(
            f"{owner}'s objective is a {type(objective).__name__}, which is not a "
            "thundersync.engine.objective.StreamingObjective; give it a thundersync.RewardLinearBackward "
            "(GRPO) or a thundersync.OPDStream (OPD)"
        )
