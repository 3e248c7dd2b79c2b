"""LearnerProcess: a streaming objective served by a child process over the
parent's parameters (shared memory on the CPU, CUDA IPC on a GPU): the gradient it leaves in the
parent's p.grad, and the step and metrics of a trainer over it, equal one process's (fp64,
1e-10); failures come back with their type."""

from __future__ import annotations

import copy
import functools
import os
import pickle
import queue
import random
import typing
from multiprocessing.reduction import ForkingPickler
from typing import Any

import anyio
import msgspec
import pytest
import torch

import thundersync
from tests.engine.tiny_models import tiny_qwen3, with_lora
from thundersync.engine.process import ModelProcess, messages, rebuilt
from thundersync.engine.process.child import HANDLERS, ObjectiveServer
from thundersync.engine.process.messages import Failed, Message, Stop
from thundersync.errors import ConfigError, StreamingError, UnknownIdError, UnsafeStepError
from thundersync.events import BatchReady
from thundersync.stages.step import StepResult

SGD = functools.partial(torch.optim.SGD, lr=0.5)
GRPO = functools.partial(thundersync.RewardLinearBackward, pack_tokens=64)


def batch_calls(seed: int) -> list[tuple[str, tuple, dict]]:
    """A GRPO batch of 2 groups x 3 trajectories (two turns each), its groups interleaved."""
    rng = random.Random(seed)
    calls: list[tuple[str, tuple, dict]] = [
        ("open_group", (g, [rng.randrange(97) for _ in range(5)]), {}) for g in (0, 1)
    ]
    for t in range(3):
        for g in (0, 1):
            action = [rng.randrange(97) for _ in range(rng.randint(1, 6))]
            observation = [rng.randrange(97) for _ in range(3)]
            calls.append(("append_turn", (g, t, action, [True] * len(action)), {}))
            calls.append(("append_turn", (g, t, torch.tensor(observation), [False] * 3), {}))
            calls.append(("close_trajectory", (g, t), {"reward": rng.choice([0.0, 1.0, 0.25])}))
    return [*calls, ("close_group", (0,), {}), ("close_group", (1,), {})]


def one_process_step(model: torch.nn.Module, objective_class, calls, grads=None) -> list[torch.Tensor]:
    """p.grad after ``calls`` and assert_safe_to_step in one process, starting from ``grads``."""
    run = thundersync.StreamingRun(model)
    for p, g in zip(run.params, grads or [None] * len(run.params), strict=True):
        p.grad = None if g is None else g.clone()
    objective = objective_class(run)
    for name, args, kwargs in calls:
        getattr(objective, name)(*args, **kwargs)
    objective.assert_safe_to_step()
    return [p.grad.clone() for p in run.params]


def test_a_learner_process_leaves_the_one_process_gradient_in_the_parents_grads() -> None:
    model = tiny_qwen3(torch.float32, seed=3).double()  # transformers' own modules: the child rebuilds them
    reference = copy.deepcopy(model)
    first = one_process_step(reference, GRPO, batch_calls(0))
    SGD(list(reference.parameters())).step()
    held = [torch.randn_like(g) for g in first]  # a second batch adds into gradients already there
    second = one_process_step(reference, GRPO, batch_calls(1), held)

    run = thundersync.StreamingRun(model)
    optimizer = SGD(run.params)
    with thundersync.LearnerProcess(run, GRPO) as learner:
        assert learner.signal == "reward" and isinstance(learner, thundersync.engine.StreamingObjective)
        for name, args, kwargs in batch_calls(0):
            getattr(learner, name)(*args, **kwargs)
        learner.assert_safe_to_step()
        for p, want in zip(run.params, first, strict=True):
            torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-10)
        optimizer.step()  # here, over the memory the child reads
        for p, g in zip(run.params, held, strict=True):
            p.grad = g.clone()
        for name, args, kwargs in batch_calls(1):
            getattr(learner, name)(*args, **kwargs)
        learner.assert_safe_to_step()
        for p, want in zip(run.params, second, strict=True):
            torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-10)

        # a failed call poisons the batch until discard(), which leaves p.grad as it was
        before = [p.grad.clone() for p in run.params]
        learner.open_group(7, [1, 2, 3])
        learner.append_turn(8, 0, [4], [True])  # no group 8
        for _ in range(2):
            with pytest.raises(UnknownIdError, match="8") as raised:
                learner.assert_safe_to_step()
            assert any("in the learner process" in note for note in raised.value.__notes__)
        learner.discard()
        assert all(torch.equal(p.grad, b) for p, b in zip(run.params, before, strict=True))

        # pending work is refused and the batch stays open; a parameter written here mid-batch is
        # caught by this process's guard: the batch is dropped, p.grad untouched
        learner.open_group(7, [1, 2, 3])
        learner.append_turn(7, 0, [4, 5], [True, True])
        with pytest.raises(UnsafeStepError, match="pending|not closed|open"):
            learner.assert_safe_to_step()
        learner.close_trajectory(7, 0, reward=1.0)
        learner.append_turn(7, 1, [6], [True])
        learner.close_trajectory(7, 1, reward=0.0)
        learner.close_group(7)
        with torch.no_grad():
            run.params[0].add_(1.0)
        with pytest.raises(UnsafeStepError, match="modified"):
            learner.assert_safe_to_step()
        assert all(torch.equal(p.grad, b) for p, b in zip(run.params, before, strict=True))
        for name, args, kwargs in batch_calls(2):  # a fresh batch runs
            getattr(learner, name)(*args, **kwargs)
        learner.assert_safe_to_step()
    assert not learner._child.process.is_alive()


def two_batches_with_a_step_between(model: torch.nn.Module, **options: Any) -> list[list[torch.Tensor]]:
    """p.grad after each of two batches of a LearnerProcess(run, GRPO, **options), an SGD step
    between them (and gradients already held when the second begins)."""
    run = thundersync.StreamingRun(model)
    optimizer = SGD(run.params)
    grads = []
    with thundersync.LearnerProcess(run, GRPO, **options) as learner:
        for batch in (0, 1):
            for name, args, kwargs in batch_calls(batch):
                getattr(learner, name)(*args, **kwargs)
            learner.assert_safe_to_step()
            grads.append([p.grad.clone() for p in run.params])
            optimizer.step()
            torch.manual_seed(batch)
            for p in run.params:
                p.grad = torch.randn_like(p)
    return grads


def one_process_two_batches(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """What :func:`two_batches_with_a_step_between` must give, computed in one process."""
    want, held = [], None
    for batch in (0, 1):
        want.append(one_process_step(model, GRPO, batch_calls(batch), held))
        SGD(list(model.parameters())).step()
        torch.manual_seed(batch)
        held = [torch.randn_like(p) for p in model.parameters() if p.requires_grad]
    return want


def test_a_learner_process_hands_all_groups_opened_to_its_objective() -> None:
    """The child's GRPO flushes its waiting branches as one process does (bitwise the same packs),
    which sums otherwise than the same batch without the call."""
    calls = batch_calls(2)
    flushed = [*calls[:2], ("all_groups_opened", (), {}), *calls[2:]]
    tail = functools.partial(thundersync.RewardLinearBackward, pack_tokens=64, tail_groups=2)
    model = tiny_qwen3(torch.float32, seed=3).double()
    want = one_process_step(copy.deepcopy(model), tail, flushed)
    unflushed = one_process_step(copy.deepcopy(model), tail, calls)
    assert not all(torch.equal(a, b) for a, b in zip(want, unflushed, strict=True))
    run = thundersync.StreamingRun(model)
    with thundersync.LearnerProcess(run, tail) as learner:
        for name, args, kwargs in flushed:
            getattr(learner, name)(*args, **kwargs)
        learner.assert_safe_to_step()
    assert all(torch.equal(p.grad, w) for p, w in zip(run.params, want, strict=True))


@pytest.mark.parametrize("lora", [False, True])
def test_a_learner_on_a_device_of_its_own_copies_the_parameters_each_batch_and_gives_the_same_gradient(
    lora: bool,
) -> None:
    """``device=``: the child computes on its own copy of the parameters, taken again at every
    batch's first call (a peft model: its adapters; its frozen base once, at start). On the CPU
    the copy is private memory; without the refresh the second batch would be computed at the
    first batch's parameters, before the step."""
    if lora:
        pytest.importorskip("peft")
    model = tiny_qwen3(torch.float32, seed=7).double()
    model = with_lora(model) if lora else model
    want = one_process_two_batches(copy.deepcopy(model))
    got = two_batches_with_a_step_between(model, device="cpu")
    for batch in (0, 1):
        for g, w in zip(got[batch], want[batch], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_a_learner_device_of_another_kind_or_out_of_range_is_refused_before_any_process_starts() -> None:
    run = thundersync.StreamingRun(tiny_qwen3(torch.float32, seed=1))
    with pytest.raises(ConfigError, match="'gpu:1' is not a torch device"):
        thundersync.LearnerProcess(run, GRPO, device="gpu:1")
    with pytest.raises(ConfigError, match="cuda:0 is not of the model's kind"):
        thundersync.LearnerProcess(run, GRPO, device="cuda:0")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES='1' in its environment would renumber them"):
        thundersync.LearnerProcess(run, GRPO, device="cpu", env={"CUDA_VISIBLE_DEVICES": "1"})


def test_a_streaming_trainer_over_a_learner_process_audits_and_reports_as_in_one_process() -> None:
    model = tiny_qwen3(torch.float32, seed=4).double()
    reference = copy.deepcopy(model)
    rng = random.Random(1)
    calls: list[tuple[str, tuple, dict]] = [("open_group", ("g", [5, 6, 7]), {})]
    for t in range(3):
        action = [rng.randrange(97) for _ in range(4)]
        scores = torch.tensor([-rng.uniform(0.5, 5.0) for _ in action], dtype=torch.float64)  # travels as a list
        behaviour = [-rng.uniform(0.5, 5.0) for _ in action]
        kwargs = {"teacher_logprobs": scores, "behaviour_logprobs": behaviour}
        calls.append(("append_turn", ("g", t, action, [True] * 4), kwargs))
        calls.append(("close_trajectory", ("g", t), {}))
    calls.append(("close_group", ("g",), {}))

    def train(objective, run) -> StepResult:
        trainer = thundersync.StreamingTrainer(objective, SGD(run.params), max_grad_norm=0.5, audit_every=1)
        for name, args, kwargs in calls:
            getattr(objective, name)(*args, **kwargs)
        return anyio.run(trainer.step, BatchReady(batch_id=0, num_groups=1))

    run = thundersync.StreamingRun(reference)
    want = train(thundersync.OPDStream(run), run)
    run = thundersync.StreamingRun(model)
    with thundersync.LearnerProcess(run, thundersync.OPDStream) as learner:
        assert learner.signal == "teacher"
        got = train(learner, run)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert want.audit_rel_error is not None and want.audit_rel_error < 1e-6  # the dense reference differs in rounding
    assert got.audit_rel_error == pytest.approx(want.audit_rel_error, rel=1e-6)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-10)
    assert got.logprob_mismatch == pytest.approx(want.logprob_mismatch, rel=1e-12)


def test_a_child_failure_whose_type_needs_more_than_a_message_comes_back_as_a_streaming_error() -> None:
    error = rebuilt(Failed(type="MissingExtraError", message="no vllm", traceback="Traceback ...", in_batch=True))
    assert type(error) is StreamingError and str(error) == "MissingExtraError: no vllm"
    assert error.__notes__ == ["in the learner process:\nTraceback ..."]
    assert (
        type(rebuilt(Failed(type="UnsafeStepError", message="pending: g", traceback="", in_batch=True)))
        is UnsafeStepError
    )


def test_a_peft_model_is_rebuilt_in_the_child_and_its_adapter_gets_the_one_process_gradient() -> None:
    pytest.importorskip("peft")
    model = with_lora(tiny_qwen3(torch.float32, seed=6).double())
    want = one_process_step(copy.deepcopy(model), GRPO, batch_calls(3))
    run = thundersync.StreamingRun(model)
    assert all("lora" in name for name, p in model.named_parameters() if p.requires_grad)
    with thundersync.LearnerProcess(run, GRPO) as learner:
        for name, args, kwargs in batch_calls(3):
            getattr(learner, name)(*args, **kwargs)
        learner.assert_safe_to_step()
    assert len(want) == len(run.params)
    for p, g in zip(run.params, want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)


def test_a_model_without_a_config_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match=r"type\(model\)\(model.config\); Linear has no config"):
        ModelProcess(torch.nn.Linear(2, 2), _never_served)


async def _never_served(*args: object) -> None:
    raise AssertionError("no child should start")


def test_the_child_gets_the_environment_it_is_given_and_the_parent_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("THUNDERSYNC_PROBE_KEPT", "parent")
    monkeypatch.delenv("THUNDERSYNC_PROBE_SET", raising=False)
    env = {"THUNDERSYNC_PROBE_SET": "child", "THUNDERSYNC_PROBE_KEPT": "child too"}
    child = ModelProcess(tiny_qwen3(torch.float32, seed=1), _serve_environment, list(env), env=env)
    try:
        assert child.receive(Environment).values == env
    finally:
        child.close()
    assert os.environ["THUNDERSYNC_PROBE_KEPT"] == "parent" and "THUNDERSYNC_PROBE_SET" not in os.environ
    with pytest.raises(ConfigError, match=r"needs a string value without NUL, got 1; quote it"):
        ModelProcess(tiny_qwen3(torch.float32, seed=1), _never_served, env={"CUDA_MPS_CLIENT_PRIORITY": 1})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"needs a name without '=' or NUL, got 'A=B'"):
        thundersync.LearnerProcess(thundersync.StreamingRun(tiny_qwen3(torch.float32, seed=1)), GRPO, env={"A=B": "1"})


class Environment(Message, frozen=True):
    values: dict[str, str | None]


async def _serve_environment(model: torch.nn.Module, commands: Any, answers: Any, names: list[str]) -> None:
    answers.put(Environment(values={name: os.environ.get(name) for name in names}))
    assert isinstance(commands.get(), Stop)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.filterwarnings("ignore:Attempting to run cuBLAS, but there was no current CUDA context:UserWarning")
def test_on_two_gpus_the_learner_on_the_second_gives_the_one_process_gradient_over_steps() -> None:
    """``device="cuda:1"``: the model and its optimizer on cuda:0, the learner's copy on cuda:1,
    taken again at every batch (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_qwen3(torch.float32, seed=5).cuda()
    want = one_process_two_batches(copy.deepcopy(model))
    got = two_batches_with_a_step_between(model, device="cuda:1")
    for batch in (0, 1):
        for g, w in zip(got[batch], want[batch], strict=True):
            assert g.device == torch.device("cuda:0")
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="needs an index of one of this process's"):
        thundersync.LearnerProcess(thundersync.StreamingRun(model), GRPO, device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# torch warns once per process when a thread's first cuBLAS call finds no current CUDA context (the
# engine's worker thread, when nothing else used the GPU before); it then sets the primary context
@pytest.mark.filterwarnings("ignore:Attempting to run cuBLAS, but there was no current CUDA context:UserWarning")
def test_on_cuda_the_child_computes_over_the_parents_memory_as_one_process_would() -> None:
    """CUDA IPC: the child's parameters and the gradient's buffers are the parent's allocations (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_qwen3(torch.float32, seed=5).cuda()
    want = one_process_step(copy.deepcopy(model), GRPO, batch_calls(2))
    run = thundersync.StreamingRun(model)
    with thundersync.LearnerProcess(run, GRPO) as learner:
        for name, args, kwargs in batch_calls(2):
            getattr(learner, name)(*args, **kwargs)
        learner.assert_safe_to_step()
    for p, g in zip(run.params, want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


# --- the messages --------------------------------------------------------------------------------

SAMPLES: list[messages.Message] = [
    messages.Seen(),
    messages.Stop(),
    messages.Begin(held=[True, False]),
    messages.OpenGroup(group_id=3, prompt_tokens=[1, 2, 3]),
    messages.AppendTurn(group_id="g", trajectory_id=0, tokens=[4, 5], scored=[True, False]),
    messages.AppendTurn(
        group_id=1, trajectory_id="t", tokens=[6], scored=[True], teacher_logprobs=[-0.5], behaviour_logprobs=[-1.25]
    ),
    messages.CloseTrajectory(group_id=3, trajectory_id=1, reward=0.25),
    messages.CloseTrajectory(group_id=3, trajectory_id=2),
    messages.CloseGroup(group_id=3),
    messages.AllGroupsOpened(),
    messages.KeepBatch(keep=False),
    messages.AssertSafe(),
    messages.Discard(),
    messages.TakeMismatch(),
    messages.DenseGradient(),
    messages.Written(name="model.embed_tokens.weight", value=4.0),
    messages.Restored(),
    messages.Crashed(traceback="Traceback ..."),
    messages.Ready(signal="reward"),
    messages.Done(),
    messages.Value(value=0.125),
    messages.Value(value=None),
    messages.Safe(held=[True, True, False]),
    messages.Failed(type="UnknownIdError", message="no group 8", traceback="Traceback ...", in_batch=True),
]


def test_every_message_type_has_a_sample_and_belongs_to_one_union() -> None:
    assert {type(m) for m in SAMPLES} == {*messages.COMMAND_TYPES, *messages.ANSWER_TYPES}
    assert not set(messages.COMMAND_TYPES) & set(messages.ANSWER_TYPES)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_pickle_and_msgspec_and_is_frozen(message: messages.Message) -> None:
    union = messages.Command if isinstance(message, messages.COMMAND_TYPES) else messages.Answer
    assert pickle.loads(pickle.dumps(message)) == message
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=union) == message
    assert msgspec.json.decode(msgspec.json.encode(message), type=union) == message
    assert msgspec.json.encode(message).startswith(b'{"kind":"' + type(message).__name__.encode())
    assert type(message).__struct_config__.frozen
    for field in message.__struct_fields__:
        with pytest.raises(AttributeError):
            setattr(message, field, None)


def test_the_start_envelope_carries_the_tensors_through_torchs_pickler_without_a_copy() -> None:
    weight = torch.zeros(4)
    start = messages.Start(
        build=dict,
        tensors={"w": weight},
        frozen=frozenset({"w"}),
        serve=_never_served,
        args=(1,),
        threads=2,
        device=None,
    )
    received = pickle.loads(ForkingPickler.dumps(start))  # what a torch.multiprocessing queue does
    assert received.frozen == frozenset({"w"}) and received.args == (1,) and received.serve is _never_served
    received.tensors["w"][0] = 5.0
    assert weight[0] == 5.0, "the tensor was copied, not shared"
    with pytest.raises(AttributeError):
        start.threads = 1  # type: ignore[misc]  # frozen: the assignment must fail


def test_the_childs_handler_table_covers_every_command_but_the_proofs() -> None:
    assert set(HANDLERS) == set(messages.COMMAND_TYPES) - {messages.Seen}  # Seen: read by the start's proof
    for kind, handler in HANDLERS.items():  # each handler takes the message it is the handler of
        assert typing.get_type_hints(handler)["message"] is kind, (kind, handler)


def test_a_message_the_child_does_not_serve_is_an_error_naming_it() -> None:
    run = thundersync.StreamingRun(tiny_qwen3(torch.float32, seed=1))
    grads = [torch.zeros(stop - start) for start, stop in run.layout.spans]
    answers: queue.Queue[messages.Message] = queue.Queue()
    server = ObjectiveServer(run, GRPO(run), grads, answers)
    with pytest.raises(
        StreamingError, match=r"got \('call', 'open_group'\) \(not a Command of .*it serves AllGroupsOpened, AppendTurn"
    ):
        server.handle(("call", "open_group"))
    with pytest.raises(StreamingError, match=r"got Ready\(signal='reward'\) \(not a Command"):
        server.handle(messages.Ready(signal="reward"))  # an answer
    with pytest.raises(StreamingError, match=r"got Seen\(\), which it does not serve"):
        server.handle(messages.Seen())  # the start's proof's, over by now
    server.handle(messages.Discard())  # a served command is answered
    assert answers.get_nowait() == messages.Done()


@pytest.mark.timeout(120)
def test_a_garbled_message_to_the_learner_process_comes_back_as_an_error_and_a_dead_child_is_reported() -> None:
    run = thundersync.StreamingRun(tiny_qwen3(torch.float32, seed=1))
    with thundersync.LearnerProcess(run, GRPO) as learner:
        learner._child.commands.put("garbage")  # not a message: the child's loop cannot serve it
        with pytest.raises(StreamingError, match=r"(?s)waited for Safe or Failed.*got 'garbage' \(not a Command"):
            learner.assert_safe_to_step()
        with pytest.raises(StreamingError, match=r"exited \(code 1\) before answering Done or Failed"):
            learner.discard()
    with thundersync.LearnerProcess(run, GRPO) as learner:
        learner._child.process.kill()
        with pytest.raises(StreamingError, match=r"exited \(code -9\) before answering Safe or Failed"):
            learner.assert_safe_to_step()
