"""TorchGenerator against transformers on a tiny random Qwen3 (fp32, CPU)."""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel
import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync.errors import ConfigError
from thundersync.generation import GenerationRequest, SamplingParams, TorchGenerator, generate_many
from thundersync.model.anatomy import adapter_lock

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def run(generator: TorchGenerator, requests: list[GenerationRequest]) -> list:
    return anyio.run(generate_many, generator, requests)


def hf_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


prompts_strategy = st.lists(st.lists(st.integers(2, 319), min_size=1, max_size=24), min_size=1, max_size=5)


@settings(max_examples=6, deadline=None)
@given(prompts=prompts_strategy, max_batch=st.integers(1, 3))
def test_greedy_equals_transformers_generate_token_for_token(make_qwen3, prompts, max_batch) -> None:
    model = make_qwen3()
    generator = TorchGenerator(model, max_batch=max_batch, max_seq_len=64)
    results = run(generator, [GenerationRequest(prompt_ids=p, params=GREEDY) for p in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(model, prompt, 12)
        assert result.finish_reason == "length"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=3),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=16, seed=4),
        SamplingParams(temperature=0.0, max_new_tokens=16),
    ],
)
def test_behaviour_logprobs_equal_teacher_forced_logprobs(make_qwen3, params) -> None:
    model = make_qwen3()
    prompts = [[5, 9, 33, 2], [100, 7], list(range(40, 70))]
    results = run(
        TorchGenerator(model, max_batch=2, max_seq_len=64),
        [GenerationRequest(prompt_ids=p, params=params) for p in prompts],
    )
    for prompt, result in zip(prompts, results, strict=True):
        expected = teacher_forced_logprobs(model, prompt, result.token_ids)
        torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)


def reference_sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Plain per-token loop: keep top-k, then the smallest top-p prefix; log-softmax of the rest."""
    scaled = (logits.double() / temperature).tolist()
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k else order
    probs = torch.tensor([scaled[i] for i in kept]).softmax(0).tolist()
    mass, final = 0.0, []
    for index, p in zip(kept, probs):
        if mass >= top_p and final:
            break
        final.append(index)
        mass += p
    masked = torch.full((len(scaled),), float("-inf"), dtype=torch.float64)
    masked[final] = torch.tensor([scaled[i] for i in final], dtype=torch.float64)
    return masked.log_softmax(0)


def test_sampling_logprobs_are_those_of_the_filtered_distribution(make_qwen3) -> None:
    model = make_qwen3()
    prompt = [7, 8, 9]
    params = SamplingParams(temperature=0.6, top_k=30, top_p=0.8, max_new_tokens=10, seed=11, logprobs="sampling")
    (result,) = run(
        TorchGenerator(model, max_batch=1, max_seq_len=64), [GenerationRequest(prompt_ids=prompt, params=params)]
    )
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1 : -1]
    for step, token in enumerate(result.token_ids):
        reference = reference_sampling_logprobs(logits[step], 0.6, 30, 0.8)
        assert reference[token] > float("-inf"), "sampled a token outside top-k/top-p"
        assert abs(result.logprobs[step] - reference[token].item()) < 1e-5


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.75)])
def test_sampling_frequencies_match_the_distribution(make_qwen3, chi_square, temperature, top_k, top_p) -> None:
    model = make_qwen3(vocab_size=8, seed=1, initializer_range=0.05)
    prompt = [3, 1, 4, 1, 5]
    n = 3000
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, seed=s) for s in range(n)
    ]
    results = run(
        TorchGenerator(model, max_batch=64, max_seq_len=16),
        [GenerationRequest(prompt_ids=prompt, params=p) for p in params],
    )
    counts = [0] * 8
    for result in results:
        counts[result.token_ids[0]] += 1
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    probs = reference_sampling_logprobs(logits, temperature, top_k, top_p).exp()
    support = [i for i in range(8) if probs[i] > 0]
    assert all(counts[i] == 0 for i in range(8) if i not in support)
    assert len(support) > 2
    p_value = chi_square([counts[i] for i in support], [n * probs[i].item() for i in support])
    assert p_value > 1e-3, (counts, probs.tolist())


def test_stop_tokens_end_generation_and_max_tokens_bounds_it(make_qwen3) -> None:
    model = make_qwen3()
    prompt = [11, 12, 13]
    free = hf_greedy(model, prompt, 12)
    stop = free[4]
    first = free.index(stop)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop, 319 if stop != 319 else 318))
    short = SamplingParams(temperature=0.0, max_new_tokens=3)
    stopped, limited = run(
        TorchGenerator(model, max_batch=2, max_seq_len=64),
        [GenerationRequest(prompt_ids=prompt, params=params), GenerationRequest(prompt_ids=prompt, params=short)],
    )
    assert stopped.token_ids == free[: first + 1] and stopped.finish_reason == "stop"
    assert limited.token_ids == free[:3] and limited.finish_reason == "length"


def test_sequence_capacity_ends_generation_with_length(make_qwen3) -> None:
    model = make_qwen3()
    (result,) = run(
        TorchGenerator(model, max_batch=1, max_seq_len=10), [GenerationRequest(prompt_ids=[4, 5, 6, 7], params=GREEDY)]
    )
    assert len(result.token_ids) == 6 and result.finish_reason == "length"
    assert result.token_ids == hf_greedy(model, [4, 5, 6, 7], 6)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_continuing_a_session_reuses_the_cache_and_equals_generating_from_the_full_prefix(
    make_qwen3, temperature
) -> None:
    model = make_qwen3()
    params = SamplingParams(temperature=temperature, max_new_tokens=8, seed=5)
    prompt, observation = [20, 21, 22, 23], [250, 251, 252]
    generator = TorchGenerator(model, max_batch=2, max_seq_len=64)

    async def two_turns() -> tuple:
        first = await generator.generate(GenerationRequest(prompt_ids=prompt, params=params, session_id="a"))
        full = prompt + first.token_ids + observation
        second = await generator.generate(GenerationRequest(prompt_ids=full, params=params, session_id="a"))
        return first, full, second

    first, full, second = anyio.run(two_turns)
    assert second.cached_tokens == len(prompt) + len(first.token_ids) - 1
    tally = generator.tally  # what the batcher did: two prefills, of the uncached tokens alone
    assert (tally.prefills, tally.prefilled_tokens) == (2, len(prompt) + len(full) - second.cached_tokens)
    # each request's first token comes with its prefill, the others one decode row each
    assert tally.decoded_rows == tally.decode_steps == len(first.token_ids) - 1 + len(second.token_ids) - 1
    assert tally.steps >= tally.decode_steps and tally.prefill_s > 0 and tally.decode_s > 0
    tally.steps = -1
    assert generator.tally.steps > 0  # a copy
    (fresh,) = run(
        TorchGenerator(model, max_batch=2, max_seq_len=64), [GenerationRequest(prompt_ids=full, params=params)]
    )
    assert fresh.cached_tokens == 0
    assert second.token_ids == fresh.token_ids
    torch.testing.assert_close(torch.tensor(second.logprobs), torch.tensor(fresh.logprobs), atol=1e-5, rtol=0)


def test_evicted_session_is_recomputed_correctly(make_qwen3) -> None:
    model = make_qwen3()
    generator = TorchGenerator(model, max_batch=1, max_seq_len=64)

    async def scenario() -> tuple:
        first = await generator.generate(GenerationRequest(prompt_ids=[30, 31], params=GREEDY, session_id=1))
        await generator.generate(GenerationRequest(prompt_ids=[40, 41], params=GREEDY))  # takes the only slot
        full = [30, 31, *first.token_ids, 99]
        return full, await generator.generate(GenerationRequest(prompt_ids=full, params=GREEDY, session_id=1))

    full, second = anyio.run(scenario)
    assert second.cached_tokens == 0
    assert second.token_ids == hf_greedy(model, full, 12)


def test_batch_neighbours_do_not_change_a_seeded_sequence(make_qwen3) -> None:
    model = make_qwen3()
    target = GenerationRequest(
        prompt_ids=[60, 61, 62], params=SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=20, seed=42)
    )
    (alone,) = run(TorchGenerator(model, max_batch=1, max_seq_len=64), [target])
    neighbours = [
        GenerationRequest(
            prompt_ids=[70 + i] * (i + 1),
            params=SamplingParams(temperature=0.5 + i / 10, top_k=i * 3, max_new_tokens=5 + 4 * i, seed=i),
        )
        for i in range(5)
    ]
    crowded = run(TorchGenerator(model, max_batch=4, max_seq_len=64), [*neighbours[:2], target, *neighbours[2:]])
    assert crowded[2].token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor(crowded[2].logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    different_seed = GenerationRequest(
        prompt_ids=target.prompt_ids, params=SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=20, seed=43)
    )
    assert run(TorchGenerator(model, max_batch=1, max_seq_len=64), [different_seed])[0].token_ids != alone.token_ids


def _fp64_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of an fp64 ``model`` whose norms compute in fp64 and whose attention is sdpa (fp64 softmax)."""
    import copy

    from tests.engine.tiny_models import use_native_norms

    reference = copy.deepcopy(model)
    reference.config._attn_implementation = "sdpa"
    use_native_norms(reference)
    return reference


def test_an_fp64_models_logprobs_are_fp64_and_independent_of_batch_neighbours(make_qwen3) -> None:
    """An fp64 model generates in fp64 throughout (norms, attention softmax, logits, temperature):
    a request's behaviour log-probs equal an fp64 teacher-forced reference to 1e-10 whether it runs
    alone or prefilled and decoded beside others of other lengths (on main: fp32 steps, ~1e-8)."""
    model = make_qwen3().double()
    reference = _fp64_reference(model)
    gen = torch.Generator().manual_seed(11)
    requests = [
        GenerationRequest(
            prompt_ids=torch.randint(2, 320, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist(),
            params=SamplingParams(temperature=0.7 + 0.1 * i, max_new_tokens=10 + i, seed=100 + i, logprobs="sampling"),
        )
        for i in range(5)
    ]
    crowded = run(TorchGenerator(model, max_batch=5, max_seq_len=64), requests)
    for request, together in zip(requests, crowded, strict=True):
        (alone,) = run(TorchGenerator(model, max_batch=1, max_seq_len=64), [request])
        assert together.token_ids == alone.token_ids
        with torch.no_grad():
            ids = torch.tensor([request.prompt_ids + alone.token_ids])
            raw = reference(ids).logits[0, len(request.prompt_ids) - 1 : -1]
        scaled = (raw / request.params.temperature).log_softmax(-1)
        want = scaled.gather(-1, torch.tensor(alone.token_ids)[:, None])[:, 0]
        for got in (alone, together):
            err = float((torch.tensor(got.logprobs, dtype=torch.float64) - want).abs().max())
            assert err < 1e-10, f"behaviour log-probs off the fp64 reference by {err:.3g}"


def test_a_deterministic_generator_gives_each_request_the_bits_it_gets_alone(make_qwen3) -> None:
    """``deterministic``: one request at a time, whole prompt prefilled, so tokens and log-probs
    are bitwise those of the request alone, with neighbours queued and with a session's cached
    prefix (fp32: without it they differ in the last bits)."""
    model = make_qwen3()
    gen = torch.Generator().manual_seed(5)
    requests = [
        GenerationRequest(
            prompt_ids=torch.randint(2, 320, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist(),
            params=SamplingParams(temperature=0.9, top_k=3 * i, max_new_tokens=8 + i, seed=200 + i),
        )
        for i in range(5)
    ]
    crowded = run(TorchGenerator(model, max_batch=4, max_seq_len=64, deterministic=True), requests)
    for request, together in zip(requests, crowded, strict=True):
        (alone,) = run(TorchGenerator(model, max_batch=1, max_seq_len=64), [request])
        assert (together.token_ids, together.logprobs) == (alone.token_ids, alone.logprobs)
    generator = TorchGenerator(model, max_batch=2, max_seq_len=64, deterministic=True)
    first = msgspec.structs.replace(requests[0], session_id="s")
    (done,) = run(generator, [first])
    longer = msgspec.structs.replace(requests[1], prompt_ids=first.prompt_ids + done.token_ids + [9], session_id="s")
    (continued,) = run(generator, [longer])
    (fresh,) = run(
        TorchGenerator(model, max_batch=1, max_seq_len=64), [msgspec.structs.replace(longer, session_id=None)]
    )
    assert continued.cached_tokens == 0
    assert (continued.token_ids, continued.logprobs) == (fresh.token_ids, fresh.logprobs)


def test_lora_model_generates_like_transformers(make_qwen3) -> None:
    peft = pytest.importorskip("peft")
    model = make_qwen3()
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # make the adapter change the outputs
    prompt = [9, 8, 7, 6]
    (result,) = run(
        TorchGenerator(lora, max_batch=1, max_seq_len=64), [GenerationRequest(prompt_ids=prompt, params=GREEDY)]
    )
    assert result.token_ids == hf_greedy(lora, prompt, 12)
    with lora.disable_adapter():
        assert result.token_ids != hf_greedy(lora, prompt, 12)


def test_an_optimizer_step_drops_cached_prefixes(make_qwen3) -> None:
    model = make_qwen3()
    generator = TorchGenerator(model, max_batch=2, max_seq_len=64)
    prompt = [50, 51, 52]

    async def scenario() -> tuple:
        first = await generator.generate(GenerationRequest(prompt_ids=prompt, params=GREEDY, session_id="s"))
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)  # in place, like an optimizer step
        full = prompt + first.token_ids
        return full, await generator.generate(GenerationRequest(prompt_ids=full, params=GREEDY, session_id="s"))

    full, second = anyio.run(scenario)
    assert second.cached_tokens == 0
    assert second.token_ids == hf_greedy(model, full, 12)


def continue_session_after(generator: TorchGenerator, change) -> tuple:
    """Generate in a session, run ``change()``, continue the session: (full prompt, second result)."""
    prompt = [50, 51, 52]

    async def scenario() -> tuple:
        first = await generator.generate(GenerationRequest(prompt_ids=prompt, params=GREEDY, session_id="s"))
        change()
        full = prompt + first.token_ids
        return full, await generator.generate(GenerationRequest(prompt_ids=full, params=GREEDY, session_id="s"))

    return anyio.run(scenario)


def optimizer_step(model: torch.nn.Module, parameters, **kwargs) -> None:
    optimizer = torch.optim.AdamW(parameters, lr=0.05, **kwargs)
    model.zero_grad()
    model(torch.tensor([[7, 8, 9]])).logits.sum().backward()
    optimizer.step()


def test_invalidate_drops_cached_prefixes_after_unversioned_weight_writes(make_qwen3) -> None:
    model = make_qwen3()
    generator = TorchGenerator(model, max_batch=2, max_seq_len=64)
    k_proj = model.model.layers[0].self_attn.k_proj.weight

    def change() -> None:
        k_proj.data.add_(torch.randn_like(k_proj))  # torch does not version .data writes
        generator.invalidate()

    full, second = continue_session_after(generator, change)
    assert second.cached_tokens == 0
    assert second.token_ids == hf_greedy(model, full, 12)


def test_a_fused_optimizer_step_drops_cached_prefixes(make_qwen3) -> None:
    model = make_qwen3()
    generator = TorchGenerator(model, max_batch=2, max_seq_len=64)
    full, second = continue_session_after(generator, lambda: optimizer_step(model, model.parameters(), fused=True))
    assert second.cached_tokens == 0
    assert second.token_ids == hf_greedy(model, full, 12)


def test_the_optimizer_hook_ignores_other_models_and_goes_away_with_the_generator(make_qwen3) -> None:
    import gc

    from torch.optim import optimizer as optim_module

    before = set(optim_module._global_optimizer_post_hooks)  # other tests' generators may come and go
    model, other = make_qwen3(), make_qwen3(seed=1)
    generator = TorchGenerator(model, max_batch=2, max_seq_len=64)
    ours = set(optim_module._global_optimizer_post_hooks) - before
    assert len(ours) == 1
    _, second = continue_session_after(generator, lambda: optimizer_step(other, other.parameters(), fused=True))
    assert second.cached_tokens > 0
    del generator
    for _ in range(100):  # a worker thread of the last request may still hold a frame for a moment
        gc.collect()
        if not ours & set(optim_module._global_optimizer_post_hooks):
            break
        time.sleep(0.01)
    assert not ours & set(optim_module._global_optimizer_post_hooks)


def test_parameters_changing_mid_generation_fail_the_request(make_qwen3) -> None:
    from thundersync.errors import GenerationError
    from thundersync.generation._batcher import ContinuousBatcher

    model = make_qwen3()
    batcher = ContinuousBatcher(model, slots=1, capacity=32, prefill_tokens=64, key_bucket=16)
    batcher.submit(GenerationRequest(prompt_ids=[1, 2], params=GREEDY), seed=0)
    batcher.step()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(GenerationError, match="parameters changed while sequences were being generated"):
        batcher.step()


def test_invalid_requests_fail_with_clear_messages(make_qwen3) -> None:
    generator = TorchGenerator(make_qwen3(), max_batch=1, max_seq_len=8)
    with pytest.raises(ConfigError, match="prompt has 8 tokens but the generator holds at most 8"):
        anyio.run(generator.generate, GenerationRequest(prompt_ids=[1] * 8))
    with pytest.raises(ConfigError, match="token id 320 is outside the model's vocabulary of 320"):
        anyio.run(generator.generate, GenerationRequest(prompt_ids=[320]))
    with pytest.raises(ConfigError, match="cuda_graphs=True needs the model on a CUDA device"):
        TorchGenerator(make_qwen3(), cuda_graphs=True)

    async def same_session_twice() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(generator.generate, GenerationRequest(prompt_ids=[1], session_id="s"))
            await anyio.lowlevel.checkpoint()
            await generator.generate(GenerationRequest(prompt_ids=[1], session_id="s"))

    with pytest.raises(ExceptionGroup) as caught:
        anyio.run(same_session_twice)
    assert caught.group_contains(ConfigError, match="session 's' already has a request in flight")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ],
)
def test_sampling_params_validate_their_values(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


def test_an_empty_prompt_is_rejected() -> None:
    with pytest.raises(ConfigError, match="prompt_ids is empty"):
        GenerationRequest(prompt_ids=[])


def test_cancelling_the_driving_request_hands_the_batcher_to_the_others(make_qwen3) -> None:
    model = make_qwen3()
    generator = TorchGenerator(model, max_batch=4, max_seq_len=128)
    long = GenerationRequest(prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0.0, max_new_tokens=100))
    others = [GenerationRequest(prompt_ids=[5 + i, 6], params=GREEDY) for i in range(3)]
    results: list = []

    async def scenario() -> None:
        async def cancelled_long() -> None:
            with anyio.move_on_after(0.05):
                await generator.generate(long)  # the first request drives the batcher

        async def other(request: GenerationRequest) -> None:
            results.append((request.prompt_ids, await generator.generate(request)))

        async with anyio.create_task_group() as group:
            group.start_soon(cancelled_long)
            await anyio.lowlevel.checkpoint()
            for request in others:
                group.start_soon(other, request)

    anyio.run(scenario)
    assert len(results) == 3
    for prompt, result in results:
        assert result.token_ids == hf_greedy(model, prompt, 12)
    assert not generator._batcher.busy


def test_releasing_a_session_drops_its_cache(make_qwen3) -> None:
    model = make_qwen3()
    generator = TorchGenerator(model, max_batch=2, max_seq_len=64)

    async def scenario() -> tuple:
        first = await generator.generate(GenerationRequest(prompt_ids=[30, 31, 32], params=GREEDY, session_id="r"))
        full = [30, 31, 32, *first.token_ids, 5]
        generator.release("r")
        return full, await generator.generate(GenerationRequest(prompt_ids=full, params=GREEDY, session_id="r"))

    full, second = anyio.run(scenario)
    assert second.cached_tokens == 0
    assert second.token_ids == hf_greedy(model, full, 12)


def test_a_small_prefill_budget_admits_prompts_over_several_steps(make_qwen3) -> None:
    model = make_qwen3()
    prompts = [[40 + i] * (10 + i) for i in range(4)]
    generator = TorchGenerator(model, max_batch=4, max_seq_len=64, prefill_tokens=12)
    results = run(generator, [GenerationRequest(prompt_ids=p, params=GREEDY) for p in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(model, prompt, 12)


def test_cancelling_a_waiting_request_never_disturbs_the_running_ones(make_qwen3) -> None:
    model = make_qwen3()
    long = GenerationRequest(prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=40, seed=1))
    expected = run(TorchGenerator(model, max_batch=2, max_seq_len=128), [long])[0]

    async def trial(delay: float) -> list:
        generator = TorchGenerator(model, max_batch=2, max_seq_len=128)
        cancelled = GenerationRequest(
            prompt_ids=[4, 5, 6], params=SamplingParams(max_new_tokens=40, seed=2), session_id="b"
        )
        results: list = []

        async def keep(request: GenerationRequest) -> None:
            results.append(await generator.generate(request))

        async with anyio.create_task_group() as group:
            group.start_soon(keep, long)  # drives the batcher in a worker thread
            await anyio.sleep(0.001)
            with anyio.move_on_after(delay):  # cancelled while the driver's step runs
                await generator.generate(cancelled)
            await keep(long)  # runs beside the first one, in a slot the cancelled request may have held
        assert not generator._batcher.busy and not generator._batcher.sessions
        return results

    for i in range(20):
        results = anyio.run(trial, 0.001 * (i % 5))
        assert [r.token_ids for r in results] == [expected.token_ids] * 2


def test_a_batcher_failure_raises_generation_error_in_the_driver_and_the_waiting_requests(make_qwen3) -> None:
    from thundersync.errors import GenerationError

    generator = TorchGenerator(make_qwen3(), max_batch=1, max_seq_len=64)  # one slot: the second request waits
    batcher, decode, calls = generator._batcher, generator._batcher._decode, []

    def failing_decode(running) -> None:
        calls.append(len(running))
        if len(calls) == 3:
            raise RuntimeError("boom in decode")
        decode(running)

    batcher._decode = failing_decode
    caught: list[BaseException] = []

    async def one(prompt: list[int]) -> None:
        try:
            await generator.generate(GenerationRequest(prompt_ids=prompt, params=GREEDY))
        except Exception as error:
            caught.append(error)

    async def scenario() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(one, [1, 2])  # drives the batcher
            await anyio.lowlevel.checkpoint()
            group.start_soon(one, [3, 4])

    anyio.run(scenario)
    assert len(caught) == 2
    for error in caught:
        assert isinstance(error, GenerationError) and isinstance(error.__cause__, RuntimeError)
        assert str(error) == "generation failed: boom in decode"
    assert not batcher.busy


def test_a_restored_rng_state_samples_the_same_tokens_again(make_qwen3) -> None:
    model = make_qwen3()
    unseeded = [
        GenerationRequest(prompt_ids=[5 + i, 6, 7], params=SamplingParams(temperature=1.0, max_new_tokens=16))
        for i in range(3)
    ]
    first = TorchGenerator(model, max_batch=4, max_seq_len=64, seed=7)
    run(first, unseeded[:1])
    state = first.get_rng_state()
    expected = run(first, unseeded)
    restored = TorchGenerator(model, max_batch=4, max_seq_len=64, seed=999)
    assert [r.token_ids for r in run(restored, unseeded)] != [r.token_ids for r in expected]
    restored.set_rng_state(state)
    assert [r.token_ids for r in run(restored, unseeded)] == [r.token_ids for r in expected]


def test_a_worker_thread_visit_runs_steps_until_a_request_finishes_or_a_change_is_queued(
    make_qwen3, monkeypatch
) -> None:
    model = make_qwen3()
    generator = TorchGenerator(model, max_batch=4, max_seq_len=128)
    visits, steps = [], []
    plain_visit, plain_step = generator._steps, generator._batcher.step
    monkeypatch.setattr(generator, "_steps", lambda driver: (visits.append(len(steps)), plain_visit(driver)))
    monkeypatch.setattr(generator._batcher, "step", lambda: (steps.append(1), plain_step())[1])
    long = GenerationRequest(prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0.0, max_new_tokens=40))
    late = GenerationRequest(prompt_ids=[7, 8], params=GREEDY)
    results: dict[str, object] = {}

    async def scenario() -> None:
        async def one(name: str, request: GenerationRequest, delay: float) -> None:
            await anyio.sleep(delay)
            results[name] = await generator.generate(request)

        async with anyio.create_task_group() as group:
            group.start_soon(one, "long", long, 0.0)
            group.start_soon(one, "late", late, 0.02)  # joins while the first one's visit runs

    anyio.run(scenario)
    assert results["long"].token_ids == hf_greedy(model, [1, 2, 3], 40)
    assert results["late"].token_ids == hf_greedy(model, [7, 8], 12)
    assert len(visits) < len(steps) / 3  # several steps per visit, not one
    assert len(visits) >= 2  # ... but a finished request ends a visit (and so does the late one's arrival)


def test_the_weights_check_lists_the_parameters_once(make_qwen3, monkeypatch) -> None:
    model = make_qwen3()
    generator = TorchGenerator(model, max_batch=2, max_seq_len=64)
    run(generator, [GenerationRequest(prompt_ids=[1, 2], params=GREEDY)])
    pulled = []
    plain = model.parameters

    def counted(*args: object, **kwargs: object) -> object:
        for parameter in plain(*args, **kwargs):  # type: ignore[arg-type]
            pulled.append(parameter)
            yield parameter

    monkeypatch.setattr(model, "parameters", counted)
    run(generator, [GenerationRequest(prompt_ids=[1, 2], params=GREEDY)])
    assert len(pulled) < len(list(plain()))  # 13 steps: a walk per step would pull every parameter 13 times
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)  # still noticed
    assert generator._batcher.weights.changed()


def test_a_generator_steps_only_while_its_models_adapter_lock_is_free(make_qwen3) -> None:
    """A GRPO KL reference scores the policy with its adapter switched off under the model's
    adapter lock; a generator over the same module waits for it instead of sampling meanwhile."""
    model = make_qwen3()
    generator = TorchGenerator(model, max_batch=2, max_seq_len=64)
    request = GenerationRequest(prompt_ids=[5, 9, 33], params=GREEDY)
    lock = adapter_lock(model)

    async def main() -> None:
        results = []

        async def generate() -> None:
            results.append(await generator.generate(request))

        lock.acquire()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(generate)
                await anyio.sleep(0.5)
                assert not results  # its first step waits for the lock
                lock.release()
        finally:
            if lock.locked():
                lock.release()
        assert len(results) == 1 and len(results[0].token_ids) == 12

    anyio.run(main)
