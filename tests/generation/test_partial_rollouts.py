"""Partial rollouts (``max_staleness >= 1``): a sequence in flight when the optimizer changes the
weights goes on with the new weights over the keys and values its earlier tokens left, a session's
next turn reuses them (in flight or parked at the change), and each token's log-prob is the one it
was sampled with."""

from __future__ import annotations

import copy

import pytest
import torch

from thundersync.errors import ConfigError
from thundersync.generation import GenerationRequest, SamplingParams, TorchGenerator
from thundersync.generation._batcher import ContinuousBatcher
from thundersync.generation.base import allow_weight_changes
from thundersync.testing import ScriptedGenerator


def _fp64_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of an fp64 model whose norms and attention softmax compute in fp64 (as the generator's do)."""
    from tests.engine.tiny_models import use_native_norms

    reference = copy.deepcopy(model)
    reference.config._attn_implementation = "sdpa"
    use_native_norms(reference)
    return reference


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
PROMPT = [5, 9, 33, 2]


def _greedy_across(old: torch.nn.Module, new: torch.nn.Module, prompt: list[int], before: int, total: int) -> tuple:
    """The reference: ``before`` greedy tokens whose keys/values ``old`` computed (the last of them is
    decoded by ``new``), then greedy decoding with ``new`` over that cache; tokens and log-probs."""
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        out = old(torch.tensor([prompt]), use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
        for index in range(total):
            lp = logits.double().log_softmax(-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(float(lp[token]))
            model = old if index + 1 < before else new  # token `index` is decoded by the weights live then
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1]
    return tokens, logprobs


@pytest.mark.parametrize("steps_before", [1, 3])
def test_a_sequence_in_flight_goes_on_with_the_new_weights_over_its_old_keys_and_values(
    make_qwen3, steps_before
) -> None:
    model = make_qwen3().double()
    old = copy.deepcopy(model)
    batcher = ContinuousBatcher(model, slots=2, capacity=64, prefill_tokens=64, key_bucket=16)
    batcher.partial_rollouts = True
    ticket = batcher.submit(GenerationRequest(prompt_ids=PROMPT, params=GREEDY, session_id="s"), seed=0)
    for _ in range(steps_before):  # the first step prefills and samples two tokens, each later one one more
        batcher.step()
    before = len(ticket.tokens)
    assert before == steps_before + 1
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # in place, as an optimizer step writes them
    while not ticket.done:
        batcher.step()
    assert ticket.result is not None
    old, new = _fp64_reference(old), _fp64_reference(model)
    tokens, logprobs = _greedy_across(old, new, PROMPT, before, len(ticket.result.token_ids))
    assert ticket.result.token_ids == tokens
    torch.testing.assert_close(
        torch.tensor(ticket.result.logprobs, dtype=torch.float64),
        torch.tensor(logprobs, dtype=torch.float64),
        atol=1e-10,
        rtol=0,
    )
    only_old, _ = _greedy_across(old, old, PROMPT, 0, len(tokens))
    assert tokens != only_old  # the new weights did decode the tail
    _next_turn_reuses_the_keys_and_values(batcher, old, new, ticket.result, before)


def _next_turn_reuses_the_keys_and_values(batcher: ContinuousBatcher, old, new, first, before: int) -> None:
    """The session's next turn (the first turn's tokens as its prompt) prefills only the token whose
    keys and values were never computed, with the new weights, and decodes on over the old K/V."""
    full = PROMPT + first.token_ids
    again = batcher.submit(GenerationRequest(prompt_ids=full, params=GREEDY, session_id="s"), seed=0)
    while not again.done:
        batcher.step()
    assert again.result is not None and again.result.cached_tokens == len(full) - 1
    total = len(first.token_ids) + len(again.result.token_ids)
    tokens, logprobs = _greedy_across(old, new, PROMPT, before, total)
    assert again.result.token_ids == tokens[len(first.token_ids) :]
    torch.testing.assert_close(
        torch.tensor(again.result.logprobs, dtype=torch.float64),
        torch.tensor(logprobs[len(first.token_ids) :], dtype=torch.float64),
        atol=1e-10,
        rtol=0,
    )


def test_a_session_parked_across_a_weight_change_reuses_its_keys_and_values(make_qwen3) -> None:
    model = make_qwen3().double()
    old = copy.deepcopy(model)
    batcher = ContinuousBatcher(model, slots=2, capacity=64, prefill_tokens=64, key_bucket=16)
    batcher.partial_rollouts = True
    first = batcher.submit(GenerationRequest(prompt_ids=PROMPT, params=GREEDY, session_id="s"), seed=0)
    while not first.done:  # the whole first turn on the old weights; the session parks
        batcher.step()
    assert first.result is not None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # the first turn's last token is fed (its K/V computed) by the new weights, in the next turn's prefill
    _next_turn_reuses_the_keys_and_values(
        batcher, _fp64_reference(old), _fp64_reference(model), first.result, len(first.result.token_ids)
    )


def test_a_generator_accepts_weight_changes_only_once_allowed(make_qwen3) -> None:
    generator = TorchGenerator(make_qwen3(), max_batch=1, max_seq_len=64)
    assert not generator._batcher.partial_rollouts  # max_staleness = 0: a change mid-sequence fails it
    allow_weight_changes(generator, 0, "generate")
    assert not generator._batcher.partial_rollouts
    allow_weight_changes(generator, 1, "generate")
    assert generator._batcher.partial_rollouts
    allow_weight_changes(ScriptedGenerator(), 2, "generate")  # no weights: nothing to refuse


class _PushedWeights:
    """A generator whose weights are pushed to it between batches (as vLLM's and a server's are)."""

    async def generate(self, request: GenerationRequest) -> object:
        raise AssertionError("never called")


def test_a_generator_that_cannot_generate_across_weight_changes_is_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"generate generates up to max_staleness=2 policy versions ahead .*"
        r"\(_PushedWeights\) cannot generate while the weights change .* or set max_staleness = 0",
    ):
        allow_weight_changes(_PushedWeights(), 2, "generate")  # type: ignore[arg-type]  # no generate result: never called


def test_vllm_and_openai_generators_refuse_bounded_staleness() -> None:
    from thundersync.generation.openai_generator import OpenAIGenerator
    from thundersync.generation.vllm_generator import VLLMGenerator

    for cls in (OpenAIGenerator, VLLMGenerator):
        assert not hasattr(cls, "allow_weight_changes"), cls
