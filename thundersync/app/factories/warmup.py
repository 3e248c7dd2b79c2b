"""The ``supervised-warmup`` factory: a model after a short supervised warm-up on demonstrations.

Reinforcement learning needs a policy that sometimes succeeds: a model built from random weights
never writes a well-formed tool call, so every reward of a group is the same and GRPO has no
signal. A pipeline file can teach the format first, in the open::

    [objects.model]                      # what everything downstream trains and samples from
    factory = "supervised-warmup"
    model = { object = "base_model" }    # trained in place and returned
    demonstrations = { object = "demonstrations" }
    steps = 300
    batch_size = 32
    lr = 3e-3
    seed = 0

It is plain next-token cross-entropy on the tokens the model writes in each
:class:`~thundersync.tasks.demonstrations.Demonstration` (its actions; the prompt and the tool
observations are context), averaged over the batch's written tokens, with AdamW (no weight
decay) at a constant learning rate, the gradient norm clipped to ``max_grad_norm`` (a spike
late in the warm-up would undo it). Batches are drawn without replacement from the
demonstrations shuffled by ``seed``, so the warmed-up weights are a function of the file.
Its progress is a phase, ``warm-up`` (:mod:`thundersync.app.phases`): under ``thundersync run`` the live
line shows its steps, rate, loss (every ``log_every`` steps) and ETA, and it ends with a line of its
own; without a live line, a line every ``log_every`` steps and the last one. The warm-up runs when
the object is built (``thundersync check`` builds nothing); on ``--resume`` it runs too, and the
checkpoint's weights then replace its result.

``cache = "DIR"`` keeps the warmed-up weights in that directory (one safetensors file per warm-up)
and loads them when a later run repeats the same warm-up: the same starting weights, demonstrations
and settings, on the same device type and torch version (:mod:`._warmup_cache`); the phase then
shows ``cached`` and the file instead of steps. On the GPU, where a warm-up is not bitwise
repeatable, the cached result is one run's warm-up, not what this run would compute.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import msgspec
import torch
from torch import nn

from thundersync.app.factories._warmup_cache import cache_key, load_cached, save_cached
from thundersync.app.phases import phase
from thundersync.errors import ConfigError
from thundersync.tasks.demonstrations import Demonstration, DemonstrationSource

__all__ = ["supervised_warmup", "warmup_loss"]

_Positive = Annotated[int, msgspec.Meta(ge=1)]


def supervised_warmup(
    *,
    model: nn.Module,
    demonstrations: DemonstrationSource,
    steps: Annotated[int, msgspec.Meta(ge=0)] = 300,
    batch_size: _Positive = 32,
    lr: Annotated[float, msgspec.Meta(gt=0)] = 3e-3,
    max_grad_norm: Annotated[float, msgspec.Meta(gt=0)] | None = 1.0,
    seed: int = 0,
    log_every: _Positive = 50,
    cache: str | None = None,
) -> nn.Module:
    """``supervised-warmup``: ``model`` after ``steps`` AdamW steps of cross-entropy on the
    demonstrations' written tokens, clipped to ``max_grad_norm`` (None: no clipping), with
    its loss shown every ``log_every`` steps, or loaded from ``cache`` (see the module docstring);
    returned in eval mode."""
    examples = demonstrations.demonstrations()
    if not examples:
        raise ConfigError("the warm-up's demonstrations object listed none; give it at least one task")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the warm-up's model has no trainable parameter (requires_grad); nothing to warm up")
    settings = {"steps": steps, "batch_size": batch_size, "lr": lr, "max_grad_norm": max_grad_norm, "seed": seed}
    cached = None if cache is None else (Path(cache), cache_key(model, examples, settings))
    if cached is not None and (found := load_cached(model, *cached)) is not None:
        with phase("warm-up", total=1, unit="file", record=True, even=False) as advance:
            advance(1, cached=str(found))
        return model.eval()
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    device = params[0].device
    with phase("warm-up", total=steps, unit="steps", record=True) as advance:
        for step, batch in zip(range(1, steps + 1), _batches(examples, batch_size, seed)):
            loss = warmup_loss(model, batch, device)
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            if max_grad_norm is not None:
                nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            if step % log_every == 0 or step == steps:  # .item() waits for the device: not every step
                advance(step, line=step != steps, loss=f"{loss.item():.3f}")
            else:
                advance(step)
    optimizer.zero_grad(set_to_none=True)
    if cached is not None:
        save_cached(model, *cached)
    return model.eval()


def warmup_loss(model: nn.Module, batch: list[Demonstration], device: torch.device) -> torch.Tensor:
    """Mean cross-entropy of the batch's written tokens given everything before them."""
    width = max(len(d.token_ids) for d in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    written = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, demo in enumerate(batch):
        ids[row, : len(demo.token_ids)] = torch.tensor(demo.token_ids)
        written[row, : len(demo.written)] = torch.tensor(demo.written)
    ids, written = ids.to(device), written.to(device)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]  # position t predicts token t + 1
    targets = ids[:, 1:].masked_fill(~written[:, 1:], -100)  # right padding is never written: ignored
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def _batches(examples: list[Demonstration], size: int, seed: int) -> Iterator[list[Demonstration]]:
    """Endless batches of ``size``: each pass over ``examples`` in a new order drawn from ``seed``."""
    draw = random.Random(seed)
    order: list[Demonstration] = []
    while True:
        batch: list[Demonstration] = []
        while len(batch) < size:
            if not order:
                order = list(examples)
                draw.shuffle(order)
            batch.append(order.pop())
        yield batch
