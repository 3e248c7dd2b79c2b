"""VLLMGenerator's request batching without a vLLM engine (``_run_batch`` replaced): fast."""

from __future__ import annotations

import anyio
import anyio.lowlevel

from thundersync.errors import GenerationError
from thundersync.generation import GenerationRequest, VLLMGenerator


def test_a_failed_batch_raises_generation_error_in_the_driver_and_the_waiting_requests() -> None:
    generator = VLLMGenerator.__new__(VLLMGenerator)  # no engine: only the batching runs
    generator.logprobs_mode, generator._queue, generator._driving = "model", [], False
    batches: list[int] = []

    def run_batch(requests: list) -> list:
        batches.append(len(requests))
        raise RuntimeError(f"engine died in batch {len(batches)}")

    generator._run_batch = run_batch  # type: ignore[method-assign]
    caught: list[BaseException] = []

    async def one(prompt: list[int]) -> None:
        try:
            await generator.generate(GenerationRequest(prompt_ids=prompt))
        except Exception as error:
            caught.append(error)

    async def scenario() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(one, [1, 2])  # drives the first batch
            await anyio.lowlevel.checkpoint()
            group.start_soon(one, [3, 4])  # waits, then drives the second

    anyio.run(scenario)
    assert batches == [1, 1] and len(caught) == 2
    for error in caught:
        assert isinstance(error, GenerationError) and isinstance(error.__cause__, RuntimeError)
    assert sorted(str(e) for e in caught) == [f"vLLM generation failed: engine died in batch {i}" for i in (1, 2)]
