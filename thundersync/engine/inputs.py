"""Validation of what callers hand the engine: configs, ids, token ids, scored flags, rewards, log-probs.

Every check raises :class:`~thundersync.errors.ConfigError` naming the argument, showing the
value and saying what is accepted, before anything is queued: a bad input never reaches the
worker, where it would fail later and far from its cause (or, worse, not fail at all).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable
from typing import Any

import torch

from thundersync.errors import ConfigError

__all__ = ["LOGPROB_LIMIT", "check_id", "logprobs", "reward_value", "scored_flags", "token_ids"]

LOGPROB_LIMIT = 1e4
"""Log-probs must lie within +-LOGPROB_LIMIT: a probability of e^-10000 is zero in every float
format, and larger magnitudes overflow the fp32 products of the loss."""


def check_id(value: object, what: str) -> Hashable:
    """``value`` as a group or trajectory id: anything hashable (ids are dictionary keys)."""
    try:
        hash(value)
    except TypeError:
        raise ConfigError(
            f"{what} {value!r} is a {type(value).__name__}, which is not hashable; use a str, an int or a tuple"
        ) from None
    return value


def token_ids(tokens: Any, what: str, vocab: int) -> list[int]:
    """Token ids (a list of ints or a 1-D integer tensor, never bools) inside ``0 .. vocab - 1``."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise ConfigError(f"{what} must be a 1-D integer tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}")
        ids = tokens.tolist()
    elif isinstance(tokens, str | bytes) or not hasattr(tokens, "__iter__"):
        raise ConfigError(f"{what} must be a list of int token ids, got {type(tokens).__name__} {tokens!r:.80}")
    elif type(tokens) is list and all(type(t) is int for t in tokens):  # the common case, without a call per id
        ids = list(tokens)
    else:
        ids = [_token(t, what) for t in tokens]
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ConfigError(
            f"{what} holds token id {bad}, outside the vocabulary of size {vocab} (valid ids: 0..{vocab - 1})"
        )
    return ids


def _token(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a list of int token ids, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"{what} must be a list of int token ids, got {type(value).__name__} {value!r}") from None


def scored_flags(scored: Any, count: int, where: str) -> list[bool]:
    """One flag per token: bools (or 0/1 ints, or a 1-D bool tensor); never a str, a float or None."""
    if isinstance(scored, torch.Tensor):
        if scored.dim() != 1 or scored.dtype != torch.bool:
            raise ConfigError(f"scored of {where} must be a 1-D bool tensor, got {scored.dtype} {tuple(scored.shape)}")
        flags = [bool(s) for s in scored.tolist()]
    elif isinstance(scored, str | bytes) or not hasattr(scored, "__iter__"):
        raise ConfigError(
            f"scored of {where} must be a list of bools (one per token), got {type(scored).__name__} {scored!r:.80}"
        )
    elif type(scored) is list and all(type(s) is bool for s in scored):  # the common case
        flags = list(scored)
    else:
        flags = [_flag(s, where) for s in scored]
    if len(flags) != count:
        raise ConfigError(
            f"scored has {len(flags)} flags but the turn of {where} has {count} tokens; give one flag per token"
        )
    return flags


def _flag(value: Any, where: str) -> bool:
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's bool too
        return bool(value)
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number not in (0, 1):
        raise ConfigError(f"scored of {where} must hold bools (True/False or 0/1), got {value!r}")
    return bool(number)


def reward_value(reward: Any, where: str) -> float:
    """A finite real reward (a number, or a one-element tensor)."""
    if reward is None or isinstance(reward, str | bytes | bool):
        raise ConfigError(f"the reward of {where} must be a finite number, got {reward!r}")
    try:
        value = float(reward)
    except (TypeError, ValueError):
        raise ConfigError(f"the reward of {where} must be a finite number, got {type(reward).__name__}") from None
    if not math.isfinite(value):
        raise ConfigError(f"the reward of {where} is {value}; rewards must be finite")
    return value


def logprobs(values: Any, name: str, count: int, where: str, *, required: bool) -> torch.Tensor | None:
    """One log-prob per scored token, finite and within +-LOGPROB_LIMIT: a host fp64 copy (the
    caller may reuse its buffer while the turn waits for the worker)."""
    if values is None:
        if required and count:
            raise ConfigError(f"{name} are required: the turn has {count} scored tokens ({where})")
        return None
    if isinstance(values, str | bytes):
        raise ConfigError(f"{name} must be numbers, one per scored token ({where}), got {values!r:.80}")
    try:
        tensor = torch.as_tensor(values, dtype=torch.float64).reshape(-1).to("cpu", copy=True)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(f"{name} must be numbers, one per scored token ({where}): {error}") from None
    if tensor.numel() != count:
        raise ConfigError(
            f"{name} has {tensor.numel()} entries but the turn has {count} scored tokens ({where}); "
            "give one log-prob per scored token"
        )
    bad = (~torch.isfinite(tensor)).nonzero()
    if bad.numel():
        index = int(bad[0])
        raise ConfigError(f"{name}[{index}] is {float(tensor[index])} ({where}); log-probs must be finite")
    far = (tensor.abs() > LOGPROB_LIMIT).nonzero()
    if far.numel():
        index = int(far[0])
        raise ConfigError(
            f"{name}[{index}] is {float(tensor[index])} ({where}); log-probs must lie within "
            f"+-{LOGPROB_LIMIT:g} (e^-{LOGPROB_LIMIT:g} is already a zero probability)"
        )
    return tensor
