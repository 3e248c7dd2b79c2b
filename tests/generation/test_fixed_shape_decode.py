"""The fixed-shape decode step (what CUDA graphs capture): the live slots, padded to a batch bucket, decode."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import anyio
import msgspec
import pytest
import torch

from thundersync.acceleration import Acceleration
from thundersync.errors import ConfigError
from thundersync.generation import GenerationRequest, SamplingParams, TorchGenerator, generate_many
from thundersync.generation._decode_math import DecodeMath
from thundersync.generation._fixed_step import batch_buckets
from thundersync.generation._fused import FusedWeights
from thundersync.model.anatomy import decoder_anatomy


def scenario(generator: TorchGenerator, params: SamplingParams) -> list:
    """Park a session, run others beside it, then continue the session."""

    async def go() -> list:
        first = await generator.generate(GenerationRequest(prompt_ids=[3, 4, 5], params=params, session_id="a"))
        others = await generate_many(
            generator, [GenerationRequest(prompt_ids=[10 + i] * (3 + i), params=params) for i in range(3)]
        )
        full = [3, 4, 5, *first.token_ids, 77, 78]
        second = await generator.generate(GenerationRequest(prompt_ids=full, params=params, session_id="a"))
        return [first, *others, second]

    return anyio.run(go)


def fixed_shape(generator: TorchGenerator, math: DecodeMath | None = None) -> TorchGenerator:
    generator._batcher.use_fixed_step(capture=False, math=math)
    return generator


def fused_math(model: torch.nn.Module, compile: bool = False) -> DecodeMath:
    return DecodeMath(compile=compile, fused=FusedWeights(decoder_anatomy(model)))


def ragged(generator: TorchGenerator, count: int = 6) -> list:
    """``count`` seeded requests of different lengths: the live batch shrinks one by one."""
    requests = [
        GenerationRequest(
            prompt_ids=[3 + i] * (2 + i), params=SamplingParams(temperature=1.0, max_new_tokens=3 + 3 * i, seed=i)
        )
        for i in range(count)
    ]
    return anyio.run(generate_many, generator, requests)


def record_batch_sizes(generator: TorchGenerator) -> list[tuple[int, int]]:
    """(live sequences, rows decoded) of each decode step of ``generator``'s fixed step, appended as it runs."""
    batcher = generator._batcher
    plain_decode, plain_rows, sizes, live = batcher._decode, batcher.fixed._decode, [], []

    def decode(running: list) -> None:
        live.append(len(running))
        plain_decode(running)

    def rows(tokens: torch.Tensor, *args: object) -> torch.Tensor:
        sizes.append((live[-1], tokens.shape[0]))
        return plain_rows(tokens, *args)

    batcher._decode, batcher.fixed._decode = decode, rows
    return sizes


def assert_same_results(expected: list, actual: list) -> None:
    for a, b in zip(expected, actual, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_new_tokens=9),
        SamplingParams(temperature=1.0, max_new_tokens=9, seed=8),
        SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_new_tokens=9, seed=9, logprobs="sampling"),
    ],
)
def test_fixed_shape_decode_equals_row_decode_and_keeps_parked_caches(make_qwen3, params) -> None:
    model = make_qwen3()
    rows = scenario(TorchGenerator(model, max_batch=4, max_seq_len=48), params)
    fixed = scenario(fixed_shape(TorchGenerator(model, max_batch=4, max_seq_len=48)), params)
    assert fixed[-1].cached_tokens > 0
    assert_same_results(rows, fixed)


def test_the_fixed_step_launches_the_next_step_before_it_reads_tokens_and_drains_at_the_end(make_qwen3) -> None:
    model = make_qwen3()
    generator = fixed_shape(TorchGenerator(model, max_batch=8, max_seq_len=48))
    batcher, order = generator._batcher, []
    plain_launch, plain_collect = batcher._launch, batcher._collect
    batcher._launch = lambda running, *a: order.append("launch") or plain_launch(running, *a)
    batcher._collect = lambda launched: order.append("collect") or plain_collect(launched)
    assert_same_results(ragged(TorchGenerator(model, max_batch=8, max_seq_len=48)), ragged(generator))
    assert order[:3] == ["launch", "launch", "collect"]  # step 2 runs while step 1's tokens are read
    assert order.count("launch") == order.count("collect") and order[-1] == "collect"  # the last one drained
    assert batcher._inflight is None


def test_sequences_that_reach_the_cache_capacity_and_a_parked_session_decode_like_row_decode(make_qwen3) -> None:
    # a step ahead writes one key past a finished sequence: at the capacity, and into a parked
    # session's slot, whose next turn must still see exactly its own tokens
    model = make_qwen3()
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=3)

    def run(generator: TorchGenerator) -> list:
        async def go() -> list:
            results = await generate_many(
                generator,
                [
                    GenerationRequest(prompt_ids=[5, 6, 7, 8, 9], params=params),
                    GenerationRequest(prompt_ids=[3, 4], params=params, session_id="s"),
                ],
            )
            turn = [3, 4, *results[1].token_ids[:3]]  # the session continues from a prefix of its cache
            results.append(await generator.generate(GenerationRequest(prompt_ids=turn, params=params, session_id="s")))
            return results

        return anyio.run(go)

    rows = run(TorchGenerator(model, max_batch=2, max_seq_len=16))
    assert {r.finish_reason for r in rows} == {"length"} and len(rows[0].token_ids) == 16 - 5
    assert_same_results(rows, run(fixed_shape(TorchGenerator(model, max_batch=2, max_seq_len=16))))


def test_a_step_ahead_that_crosses_a_key_bucket_decodes_like_row_decode(make_qwen3) -> None:
    # the step in flight writes one key more than the bookkeeping holds: the next step's key
    # bucket must count it where the sequences cross 128 keys
    model = make_qwen3()
    requests = [
        GenerationRequest(
            prompt_ids=[3 + i] * (118 + i), params=SamplingParams(temperature=1.0, max_new_tokens=16, seed=i)
        )
        for i in range(3)
    ]
    rows = anyio.run(generate_many, TorchGenerator(model, max_batch=4, max_seq_len=300), requests)
    fixed = anyio.run(generate_many, fixed_shape(TorchGenerator(model, max_batch=4, max_seq_len=300)), requests)
    assert_same_results(rows, fixed)


def test_a_request_cancelled_while_others_decode_leaves_them_as_they_were(make_qwen3) -> None:
    model = make_qwen3()

    async def go(generator: TorchGenerator, cancel: bool) -> list:
        params = [SamplingParams(temperature=1.0, max_new_tokens=12 + 4 * i, seed=i) for i in range(3)]
        results: list = [None] * 3
        async with anyio.create_task_group() as tasks:

            async def one(i: int) -> None:
                results[i] = await generator.generate(GenerationRequest(prompt_ids=[4 + i] * 3, params=params[i]))

            async def doomed() -> None:
                with anyio.move_on_after(0.05 if cancel else 1e9):
                    await generator.generate(
                        GenerationRequest(prompt_ids=[9, 9], params=SamplingParams(max_new_tokens=40))
                    )

            for i in range(3):
                tasks.start_soon(one, i)
            tasks.start_soon(doomed)
        return results

    expected = anyio.run(go, TorchGenerator(model, max_batch=4, max_seq_len=64), False)
    generator = fixed_shape(TorchGenerator(model, max_batch=4, max_seq_len=64))
    assert_same_results(expected, anyio.run(go, generator, True))
    assert generator._batcher._inflight is None


def test_batch_buckets_are_powers_of_two_up_to_the_slot_count() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)


def test_the_fixed_step_decodes_only_the_live_slots_padded_to_a_bucket(make_qwen3) -> None:
    model = make_qwen3()
    expected = ragged(TorchGenerator(model, max_batch=8, max_seq_len=48))
    generator = fixed_shape(TorchGenerator(model, max_batch=8, max_seq_len=48))
    sizes = record_batch_sizes(generator)
    assert_same_results(expected, ragged(generator))
    assert {live for live, _ in sizes} == {1, 2, 3, 4, 5, 6}  # sequences finish one by one
    bucket = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8}
    assert all(rows == bucket[live] for live, rows in sizes)


def test_a_parked_session_padding_a_bucket_keeps_its_cache(make_qwen3) -> None:
    model = make_qwen3()
    params = SamplingParams(temperature=1.0, max_new_tokens=9, seed=4)
    generator = fixed_shape(TorchGenerator(model, max_batch=4, max_seq_len=48))
    sizes = record_batch_sizes(generator)
    fixed = scenario(generator, params)
    assert (3, 4) in sizes  # three live requests beside the parked session: its slot pads the bucket
    assert fixed[-1].cached_tokens > 0
    assert_same_results(scenario(TorchGenerator(model, max_batch=4, max_seq_len=48), params), fixed)


COMPILE_WARNING = "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"  # inductor's imports


@pytest.fixture()
def keeps_recursion_limit() -> Iterator[None]:
    """Inductor raises ``sys.getrecursionlimit()`` to 2000 when it compiles; later tests rely on the default."""
    limit = sys.getrecursionlimit()
    yield
    sys.setrecursionlimit(limit)


@pytest.mark.slow
@pytest.mark.filterwarnings(COMPILE_WARNING)
@pytest.mark.usefixtures("keeps_recursion_limit")
def test_a_compiled_decode_step_samples_what_the_eager_one_does(make_qwen3) -> None:
    model = make_qwen3()
    compiled = fused_math(model, compile=True)  # fused layers and plain ones: the first layer is not fused
    compiled.fused.layers[0] = None
    results = ragged(fixed_shape(TorchGenerator(model, max_batch=8, max_seq_len=48), compiled))
    assert compiled.failures == []
    assert_same_results(ragged(TorchGenerator(model, max_batch=8, max_seq_len=48)), results)


def failing_backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
    raise RuntimeError("no compiler here")


@pytest.mark.filterwarnings(COMPILE_WARNING)
def test_a_decode_step_that_fails_to_compile_runs_eagerly_counted_and_logged(make_qwen3, caplog) -> None:
    model = make_qwen3()
    compiled = DecodeMath(compile=True, backend=failing_backend)
    with caplog.at_level("WARNING", logger="thundersync.generation._decode_math"):
        results = ragged(fixed_shape(TorchGenerator(model, max_batch=8, max_seq_len=48), compiled), count=3)
    assert sorted(f.split(":")[0] for f in compiled.failures) == [
        "attention_inputs",
        "attention_output",
        "counter_uniform",
        "embed",
    ]
    assert all("no compiler here" in f for f in compiled.failures)
    assert len(caplog.records) == 4 and "decode_compile_failed" in caplog.records[0].getMessage()
    assert_same_results(ragged(TorchGenerator(model, max_batch=8, max_seq_len=48), count=3), results)


@pytest.mark.filterwarnings(COMPILE_WARNING)
def test_the_decode_forms_come_from_the_acceleration_the_environment_overriding_auto(make_qwen3, monkeypatch) -> None:
    model = make_qwen3()
    forms = Acceleration(decode_compile="on", decode_fuse="on")
    math = TorchGenerator(model, max_batch=2, max_seq_len=48, acceleration=forms)._batcher.decode_math
    assert math is not None and math.compile and math.fused is not None
    auto = Acceleration(decode_compile="off")  # fuse auto: on with CUDA graphs, off here
    assert TorchGenerator(model, max_batch=2, max_seq_len=48, acceleration=auto)._batcher.decode_math is None
    stacked = TorchGenerator(model, max_batch=2, max_seq_len=48, acceleration=Acceleration(decode_fuse="on"))
    assert stacked._batcher.decode_math.fused is not None and stacked.stacked_weight_bytes > 0
    assert TorchGenerator(model, max_batch=2, max_seq_len=48).stacked_weight_bytes == 0
    monkeypatch.setenv("THUNDERSYNC_DECODE_FUSE", "on")  # the environment overrides a field left auto
    assert TorchGenerator(model, max_batch=2, max_seq_len=48).stacked_weight_bytes > 0
    monkeypatch.setenv("THUNDERSYNC_DECODE_FUSE", "yes")
    with pytest.raises(ConfigError, match="THUNDERSYNC_DECODE_FUSE must be auto, on or off, got 'yes'"):
        TorchGenerator(model, max_batch=2, max_seq_len=48)


def test_stacked_projections_decode_like_the_modules(make_qwen3) -> None:
    model = make_qwen3()
    math = fused_math(model)
    assert all(layer is not None for layer in math.fused.layers)
    stacked = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
    fp32_bytes = sum(p.numel() * 4 for name, p in model.named_parameters() if name.endswith(stacked))
    assert math.fused.nbytes == fp32_bytes
    assert_same_results(
        ragged(TorchGenerator(model, max_batch=8, max_seq_len=48)),
        ragged(fixed_shape(TorchGenerator(model, max_batch=8, max_seq_len=48), math)),
    )


def test_stacked_projections_follow_an_optimizer_step(make_qwen3) -> None:
    model = make_qwen3()
    generator = fixed_shape(TorchGenerator(model, max_batch=8, max_seq_len=48), fused_math(model))
    before = ragged(generator, count=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=2e-3)
    model(torch.tensor([[7, 8, 9]])).logits.sum().backward()
    optimizer.step()
    after = ragged(generator, count=3)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert_same_results(ragged(TorchGenerator(model, max_batch=8, max_seq_len=48), count=3), after)


def test_adapter_wrapped_projections_are_not_stacked(make_qwen3) -> None:
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(make_qwen3(), peft.LoraConfig(r=4, target_modules=["k_proj"], lora_dropout=0.0))
    lora_mlp = peft.get_peft_model(make_qwen3(), peft.LoraConfig(r=4, target_modules=["up_proj"], lora_dropout=0.0))
    assert FusedWeights(decoder_anatomy(lora)).layers == [None, None]
    assert FusedWeights(decoder_anatomy(lora_mlp)).layers == [None, None]
    assert FusedWeights(decoder_anatomy(lora_mlp)).nbytes == 0


def test_integer_temperature_and_top_p_decode_like_floats(make_qwen3) -> None:
    model = make_qwen3()
    as_ints = SamplingParams(temperature=0, top_p=1, max_new_tokens=9)
    assert (type(as_ints.temperature), type(as_ints.top_p)) == (float, float)
    floats = scenario(
        fixed_shape(TorchGenerator(model, max_batch=4, max_seq_len=48)),
        SamplingParams(temperature=0.0, max_new_tokens=9),
    )
    ints = scenario(fixed_shape(TorchGenerator(model, max_batch=4, max_seq_len=48)), as_ints)
    assert [r.token_ids for r in ints] == [r.token_ids for r in floats]
    step = fixed_shape(TorchGenerator(model, max_batch=2, max_seq_len=48))._batcher.fixed
    raw = SamplingParams(temperature=0.5, top_p=0.5)
    msgspec.structs.force_setattr(raw, "temperature", 2)  # an int that bypassed the normalization
    msgspec.structs.force_setattr(raw, "top_p", 1)
    step.activate(1, token=3, position=2, params=raw, seed=0)
    step.flush()
    assert (step.temperature.tolist(), step.top_p.tolist()) == ([1.0, 2.0], [1.0, 1.0])
    with pytest.raises(ConfigError, match="temperature must be a number, got '0.5'"):
        SamplingParams(temperature="0.5")


@pytest.mark.gpu
@pytest.mark.filterwarnings(COMPILE_WARNING)
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")  # inductor, fp32 with TF32 off
@pytest.mark.parametrize("compile_decode", [False, True])
@pytest.mark.usefixtures("keeps_recursion_limit")
def test_cuda_graph_decode_matches_transformers_and_eager(make_qwen3, compile_decode) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_qwen3().cuda()
    params = SamplingParams(temperature=0.0, max_new_tokens=9)
    forms = Acceleration(decode_compile="on" if compile_decode else "off")
    graphs = TorchGenerator(model, max_batch=4, max_seq_len=300, acceleration=forms)
    assert graphs._batcher.run_fixed is not None
    captured = scenario(graphs, params)
    eager = scenario(TorchGenerator(model, max_batch=4, max_seq_len=300, cuda_graphs=False), params)
    assert_same_results(eager, captured)
    seeded = ragged(TorchGenerator(model, max_batch=8, max_seq_len=300, acceleration=forms))
    assert_same_results(ragged(TorchGenerator(model, max_batch=8, max_seq_len=300, cuda_graphs=False)), seeded)
    assert graphs._batcher.decode_math.fused is not None  # stacked projections: on with CUDA graphs
    assert graphs._batcher.decode_math.failures == []
    prompt = list(range(20, 160))  # crosses a 128-token key bucket
    (long,) = anyio.run(
        generate_many,
        graphs,
        [GenerationRequest(prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_new_tokens=20))],
    )
    reference = model.generate(
        torch.tensor([prompt], device="cuda"), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert long.token_ids == reference[0, len(prompt) :].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + long.token_ids], device="cuda")).logits[0, len(prompt) - 1 : -1].double()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(long.token_ids, device="cuda")[:, None])[:, 0].cpu()
    torch.testing.assert_close(torch.tensor(long.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)
    assert graphs._batcher.run_fixed.captured >= 2


def test_a_decode_step_whose_compile_call_raises_runs_eagerly(make_qwen3, monkeypatch) -> None:
    # torch.compile itself can raise before any graph is traced (on the H200 with torch 2.11, the
    # first import of inductor warned, which warnings-as-errors turned into an exception)
    def refuse(*args: object, **kwargs: object) -> object:
        raise DeprecationWarning("inductor import warned")

    monkeypatch.setattr(torch, "compile", refuse)
    model = make_qwen3()
    compiled = DecodeMath(compile=True)
    results = ragged(fixed_shape(TorchGenerator(model, max_batch=8, max_seq_len=48), compiled), count=3)
    assert compiled.failures and all("inductor import warned" in f for f in compiled.failures)
    assert_same_results(ragged(TorchGenerator(model, max_batch=8, max_seq_len=48), count=3), results)


def test_a_priority_stream_needs_cuda(make_qwen3) -> None:
    model = make_qwen3()
    assert TorchGenerator(model, max_batch=2, max_seq_len=48)._batcher.stream is None  # auto: off on the CPU
    with pytest.raises(ConfigError, match="decode_priority = on needs the model on a CUDA device, it is on cpu"):
        TorchGenerator(model, max_batch=2, max_seq_len=48, acceleration=Acceleration(decode_priority="on"))
    with pytest.raises(ConfigError, match="Acceleration.decode_priority must be auto, on or off, got 'high'"):
        Acceleration(decode_priority="high")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_the_priority_stream_decodes_like_the_current_one_and_sees_writes_queued_before_generate(make_qwen3) -> None:
    model = make_qwen3().cuda()
    own = TorchGenerator(model, max_batch=4, max_seq_len=64, acceleration=Acceleration(decode_compile="off"))
    assert own._batcher.stream is not None and own._batcher.stream.priority < 0  # auto: on with CUDA
    forms = Acceleration(decode_compile="off", decode_priority="off")
    current = TorchGenerator(model, max_batch=4, max_seq_len=64, acceleration=forms)
    before = ragged(own, count=4)
    assert_same_results(ragged(current, count=4), before)
    # a weight write queued on the current stream behind ~0.1 s of device sleep: requests submitted
    # after it must see it, although the generator's stream would reach them first
    torch.cuda._sleep(200_000_000)
    with torch.no_grad():
        model.model.norm.weight.neg_()  # negates the logits
    after = ragged(own, count=4)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert_same_results(ragged(current, count=4), after)


def test_a_decode_partition_needs_a_cuda_model(make_qwen3) -> None:
    with pytest.raises(
        ConfigError,
        match="decode_partition = on puts the decode on the SMs that learner_sms leaves, but the model is on cpu",
    ):
        TorchGenerator(
            make_qwen3(), max_batch=2, max_seq_len=48, acceleration=Acceleration(decode_partition="on", learner_sms=16)
        )


@pytest.mark.gpu
def test_a_decode_partition_decodes_like_the_whole_device_and_captures_on_the_sms_the_learner_leaves(
    make_qwen3, request: pytest.FixtureRequest
) -> None:
    """The decode stream and every capture under it belong to the complement of the learner's
    partition (the device's other SMs), and the requests decode as on the whole device."""
    from thundersync import _green

    device = torch.device("cuda", 0)
    if _green.missing(device) is not None:
        pytest.skip(f"no green context here: {_green.missing(device)}")
    model = make_qwen3().cuda()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    sms = max(8, total // 2 // 8 * 8)
    with pytest.raises(ConfigError, match="but learner_sms is 0; set learner_sms"):
        TorchGenerator(model, max_batch=2, max_seq_len=48, acceleration=Acceleration(decode_partition="on"))
    whole = TorchGenerator(model, max_batch=4, max_seq_len=64, acceleration=Acceleration(decode_compile="off"))
    forms = Acceleration(decode_compile="off", decode_partition="on", learner_sms=sms)
    apart = TorchGenerator(model, max_batch=4, max_seq_len=64, acceleration=forms)
    part = _green.partition_of(apart._batcher.stream)
    assert part is not None and part is _green.partition(device, sms).complement()
    assert (part.sms, part.rest_sms) == (total - sms, sms)
    assert apart._batcher.stream.priority < 0  # the highest
    asked = request.getfixturevalue("side_streams")  # from here on: the decode's warm-ups and captures
    got = ragged(apart, count=4)
    assert asked and all(_green.partition_of(stream) is part for stream in asked)
    assert_same_results(ragged(whole, count=4), got)


def test_with_no_driver_the_done_waiters_are_woken_and_one_other_drives(make_qwen3) -> None:
    # a cancel applied with no driver reads the step in flight, which can finish waiting requests:
    # the hand-off must wake those too, not only the next driver
    from thundersync.generation._batcher import Ticket

    generator = fixed_shape(TorchGenerator(make_qwen3(), max_batch=2, max_seq_len=48))

    async def go() -> list[bool]:
        request = GenerationRequest(prompt_ids=[1, 2])
        done, waiting, other = Ticket(request, 0), Ticket(request, 1), Ticket(request, 2)
        done.error = RuntimeError("finished by the step read at the cancel")
        wakes = {ticket: anyio.Event() for ticket in (done, waiting, other)}
        generator._wakes.update(wakes)
        generator._hand_off()
        return [wake.is_set() for wake in wakes.values()]

    assert anyio.run(go) == [True, True, False]


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
def test_slot_changes_swaps_and_prefill_inputs_do_not_wait_for_the_step_in_flight(make_qwen3, monkeypatch) -> None:
    # torch's blocking host-to-device copy synchronizes the stream: the decode step in flight would
    # be waited for each time a sequence is admitted, finishes or moves to a lower slot
    from thundersync.generation import _batcher

    model = make_qwen3().cuda()
    generator = TorchGenerator(model, max_batch=4, max_seq_len=64, acceleration=Acceleration(decode_compile="off"))
    batcher = generator._batcher
    calls = {"flush": 0, "compact": 0, "pack_prefill": 0}

    def strict(name: str, fn):
        def run(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    swaps = record_swaps(batcher)
    monkeypatch.setattr(batcher.fixed, "flush", strict("flush", batcher.fixed.flush))
    monkeypatch.setattr(batcher, "_compact", strict("compact", batcher._compact))
    monkeypatch.setattr(_batcher, "pack_prefill", strict("pack_prefill", _batcher.pack_prefill))
    results = ragged(generator, count=7)  # more requests than slots: admissions while others decode
    assert_same_results(ragged(TorchGenerator(model, max_batch=4, max_seq_len=64, cuda_graphs=False), count=7), results)
    assert calls["flush"] > 0 and calls["pack_prefill"] > 1 and swaps, (calls, swaps)


def record_swaps(batcher) -> list[tuple[int, int]]:
    swaps: list[tuple[int, int]] = []
    plain = batcher._swap

    def swap(a, b, ahead: int) -> None:
        swaps.append((a.index, b.index))
        plain(a, b, ahead)

    batcher._swap = swap
    return swaps
