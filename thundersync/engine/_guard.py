"""The safe-to-step guard: what must hold of the parameters for a streamed batch to be exact.

A :class:`ParameterGuard` watches one run's trainable parameters from the start of a logical
batch to its step:

- *claimed*: one batch at a time streams into a parameter, across every run that shares it.
  Two batches at once would mix their sums in ``p.grad`` (OPD writes there during its batch,
  and its division by N and its ``discard()`` would reach the other batch's part). The claims
  live in a process-wide table keyed by parameter identity; a claim ends with its batch, or
  with its run when the run is garbage-collected.
- *unchanged*: every parameter's ``_version`` at the step equals the one at the batch's start
  (in-place changes through ``.data`` are invisible to this check);
- *still the model's*: a Parameter replaced by assignment (``module.weight = nn.Parameter(...)``)
  would not receive the gradient, which goes to the object the run was made with;
- *finite*: a non-finite total (inputs too large for the accumulation dtype) never reaches ``.grad``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from thundersync.errors import ConfigError

__all__ = ["ParameterGuard", "check_deterministic"]

# id(parameter) -> (the parameter, the guard whose batch streams into it); both weak.
_claims: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[ParameterGuard]]] = {}
_claims_lock = threading.Lock()


class ParameterGuard:
    """Claims, versions and identity of one run's trainable parameters during a logical batch."""

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self.model = model
        self.params = list(params)
        self.names = {id(p): name for name, p in model.named_parameters()}
        self._versions: list[int] | None = None
        self._owner: str = ""

    def begin(self, owner: object) -> None:
        """Claim the parameters for ``owner``'s batch and record their versions."""
        replaced = self.replaced()
        if replaced:
            raise ConfigError(
                f"trainable parameters were replaced since the StreamingRun was made: {_shown(replaced)}; "
                "the run streams into the Parameter objects it was made with: make a new StreamingRun "
                "(or change values in place, e.g. with copy_())"
            )
        self._claim(type(owner).__name__)
        self._versions = [p._version for p in self.params]

    def end(self) -> None:
        """Release the claims; the parameters may join another batch."""
        with _claims_lock:
            for p in self.params:
                entry = _claims.get(id(p))
                if entry is not None and entry[1]() is self:
                    del _claims[id(p)]
        self._versions = None

    def problem(self) -> str | None:
        """What makes the batch's gradient wrong for the parameters as they are now, or ``None``."""
        replaced = self.replaced()
        if replaced:
            return (
                f"trainable parameters were replaced by new Parameter objects since the batch began: "
                f"{_shown(replaced)}; their gradients went to the old objects: change values in place "
                "(copy_()) and only after assert_safe_to_step() passes"
            )
        moved = self.moved()
        if moved:
            return (
                f"trainable parameters were modified in place since the batch began: {_shown(moved)}; "
                "the streamed gradients belong to the old values: do not change parameters until "
                "assert_safe_to_step() passes"
            )
        return None

    def non_finite(self, grads: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> str | None:
        """Name the first parameter whose gradient in ``grads`` ((parameter, gradient) pairs) is not
        finite. One read-back for all of them (on a GPU, one per parameter cost ~300 host syncs at
        every step boundary)."""
        present = [(p, grad) for p, grad in grads if grad is not None]
        if not present:
            return None
        finite = torch.stack([torch.isfinite(grad).all() for _, grad in present]).tolist()
        if all(finite):
            return None
        p = present[finite.index(False)][0]
        return (
            f"the batch's gradient is not finite (inf or nan in {self.names.get(id(p), '?')}): the "
            "inputs overflow the accumulation dtype; check for huge rewards or log-probs and scale them"
        )

    def moved(self) -> list[str]:
        if self._versions is None:
            return []
        return [self.names.get(id(p), "?") for p, v in zip(self.params, self._versions) if p._version != v]

    def replaced(self) -> list[str]:
        mine = {id(p) for p in self.params}
        current = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        missing = {id(p) for _, p in current}
        return [name for name, p in current if id(p) not in mine] + [
            self.names.get(id(p), "?") for p in self.params if id(p) not in missing
        ]

    def _claim(self, owner: str) -> None:
        with _claims_lock:
            for p in self.params:
                entry = _claims.get(id(p))
                other = entry[1]() if entry is not None and entry[0]() is p else None
                if other is not None and other is not self:
                    raise ConfigError(
                        f"parameter {self.names.get(id(p), '?')} is in a logical batch of a {other._owner} on "
                        f"another StreamingRun; two batches streaming into the same parameters would mix their "
                        f"gradients in .grad: finish that batch (assert_safe_to_step() or discard()) before this "
                        f"{owner} opens a group"
                    )
            for p in self.params:
                _claims[id(p)] = (weakref.ref(p), weakref.ref(self))
        self._owner = owner


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_deterministic(model: nn.Module) -> None:
    """Refuse a model in training mode with active dropout: replays must reproduce the forward."""
    if not model.training:
        return
    active = [name for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.training and m.p > 0]
    config = getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0
    if active or config > 0:
        what = f"dropout modules {active[:3]}" if active else f"attention_dropout={config}"
        raise ConfigError(
            f"the model is in training mode with active {what}: streamed recomputation must reproduce "
            "the forward exactly; call model.eval() (or set the dropout probabilities to 0)"
        )
