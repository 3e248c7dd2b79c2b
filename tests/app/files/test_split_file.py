"""``[run.split]`` in a pipeline file: what it may say is checked when the file is read, against
the launch when the run starts, and what the split does not run is refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from thundersync.app.cli.command import _split_launch, main
from thundersync.app.cli.distributed import Launch
from thundersync.app.files.build import build_graph, build_objects
from thundersync.app.files.definition import loads
from thundersync.app.files.split import check_world
from thundersync.errors import ConfigError, DefinitionError

ROOT = Path(__file__).resolve().parents[3]
TINY = (ROOT / "examples" / "train_tiny_grpo.toml").read_text()


def _split(rollout: str = "[1]", learner: str = "[0]") -> str:
    return f"{TINY}\n[run.split]\nrollout = {rollout}\nlearner = {learner}\n"


def test_a_placement_decodes_into_the_run_settings() -> None:
    split = loads(_split("[1, 2]", "[0]")).run.split
    assert split is not None and (split.rollout, split.learner) == ([1, 2], [0])
    assert loads(TINY).run.split is None


@pytest.mark.parametrize("shard", ["true", "false"])
def test_several_learner_ranks_are_placed_sharded_or_replicated(shard: str) -> None:
    spec = loads(_split("[0, 2]", "[1, 3]"), [f"run.shard={shard}"])
    assert spec.run.split is not None and spec.run.split.learner == [1, 3] and spec.run.shard == (shard == "true")
    assert loads(_split(), [f"run.shard={shard}"]).run.shard == (shard == "true")  # one learner: it holds the model


@pytest.mark.parametrize(
    ("rollout", "learner", "message"),
    [
        ("[1]", "[]", r"^run\.split\.learner: is empty; a split needs at least one learner rank$"),
        ("[-1]", "[0]", r"^run\.split\.rollout: ranks are >= 0, got -1 in \[-1\]$"),
        (
            "[0, 1]",
            "[0]",
            r"^run\.split: rank 0 is named in both roles \(rollout \[0, 1\], learner \[0\]\); name every",
        ),
        ("[1, 1]", "[0]", r"^run\.split: rank 1 is named in one role twice"),
        (
            "[0]",
            "[2, 1]",
            r"^run\.split\.learner: \[2, 1\] is not in increasing order; the first learner rank writes "
            r"the files and is rank 0 of the learners' group \(a sharded checkpoint's writer\): list them as \[1, 2\]$",
        ),
        (
            "[2]",
            "[0]",
            r"^run\.split: rank 2 is not a rank of 2 processes \(0\.\.1; rollout \[2\], learner \[0\]\); name",
        ),
    ],
)
def test_a_placement_that_is_not_every_rank_once_in_one_role_is_refused(
    rollout: str, learner: str, message: str
) -> None:
    with pytest.raises(DefinitionError, match=message):
        loads(_split(rollout, learner))


def test_an_unknown_field_of_the_placement_is_named_with_the_valid_ones() -> None:
    with pytest.raises(DefinitionError, match=r"^run\.split\.rolout: unknown field; valid fields: rollout, learner$"):
        loads(f"{TINY}\n[run.split]\nrolout = [1]\nlearner = [0]\n")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.max_staleness=1", r"^run\.max_staleness: 1; a split generates each batch on the learner's newest"),
        ("objects.policy.max_staleness=2", r"^objects\.policy\.max_staleness: 2; a split generates each batch"),
        ('eval={tasks="tasks"}', r"^eval: a split run does not evaluate \(not built\); drop \[eval\]"),
        ('stages.tools={type="tool-execute",reads=["generate"]}', r"^stages\.tools\.type: 'tool-execute' in a file "
         r"with \[run\.split\]; the split does not run it\. A split runs one stage of each of source, generate, "
         r"reward, backward, close, step \(and for OPD one teacher-score stage\): drop the stage, or drop "
         r"\[run\.split\]$"),
        ('stages.again={type="reward",reads=["generate"]}', r"^run\.split: the file has 2 stages of type 'reward'"),
        ("stages.generate.turns=2", r"^stages\.generate\.turns: 2; a split samples one action per trajectory"),
        ('stages.reward.overlong="filter"', r"^stages\.reward\.overlong: 'filter'; .* set overlong = \"keep\"$"),
        ('objects.admission={factory="admission"}', r"^objects\.admission\.factory: 'admission' in a file with "
         r"\[run\.split\]; each rollout rank starts its whole share of a batch at once"),
        ("objects.objective.process=true", r"^objects\.objective\.process: true; the split's learner streams"),
        ("objects.optimizer.shard_state=true", r"^objects\.optimizer\.shard_state: true; ZeRO-1 would split the "
         r"optimizer's state over every rank of the launch, rollout ranks included: drop shard_state"),

        ('objects.remote={factory="openai-generator",base_url="http://localhost:8000",model="m"}',
         r"^objects\.remote\.factory: 'openai-generator' in a file with \[run\.split\]; the learner's weights reach "
         r"each rollout rank's own model, .* an OpenAI server's weights are out of the broadcast's reach: use a "
         r"torch-generator or a vllm-generator: remove the object$"),
    ],
)  # fmt: skip
def test_what_the_split_does_not_run_is_refused_naming_the_key(override: str, message: str) -> None:
    loads(TINY, [override])  # the same file without the split is valid
    with pytest.raises(DefinitionError, match=message):
        loads(_split(), [override])


def test_a_placement_that_does_not_match_the_launch_says_how_to_launch_it() -> None:
    split = loads(_split("[1, 2]", "[0]")).run.split
    assert split is not None
    check_world(split, 3)
    with pytest.raises(
        ConfigError, match=r"but the launch has 2 \(WORLD_SIZE\); launch 3 processes \(--nproc-per-node 3\)"
    ):
        check_world(split, 2)
    with pytest.raises(ConfigError, match=r"but this is one process; launch it with torchrun --nproc-per-node 3 -m"):
        check_world(split, None)


def test_a_split_file_run_as_one_process_exits_2_with_the_launch_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "split.toml"
    path.write_text(_split())
    assert main(["run", str(path), "--metrics", str(tmp_path / "m.jsonl")]) == 2
    err = capsys.readouterr().err
    assert (
        "invalid settings (ConfigError): run.split places 2 ranks (rollout [1], learner [0]), but this is one " in err
    )
    assert "torchrun --nproc-per-node 2 -m thundersync run FILE, or drop [run.split]" in err
    assert not (tmp_path / "m.jsonl").exists()


def test_check_lists_the_placement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "split.toml"
    path.write_text(_split("[0, 2]", "[1]"))
    assert main(["check", "--offline", str(path)]) == 0
    assert "\n  split: rollout ranks [0, 2], learner rank 1 (launch 3 processes)\n" in capsys.readouterr().out
    assert main(["check", "--offline", str(path), "--set", "run.shard=true"]) == 0
    out = capsys.readouterr().out
    assert (
        "\n  split: rollout ranks [0, 2], learner rank 1, not sharded (one learner rank) (launch 3 processes)\n" in out
    )
    path.write_text(_split("[0]", "[1, 2]"))
    assert main(["check", "--offline", str(path), "--set", "run.shard=true"]) == 0
    assert (
        "\n  split: rollout ranks [0], learner ranks [1, 2], sharded (FSDP2 over the learner ranks), rank 1 writes "
        "the files (launch 3 processes)\n"
    ) in capsys.readouterr().out
    assert main(["check", "--offline", str(path)]) == 0
    assert (
        "\n  split: rollout ranks [0], learner ranks [1, 2], replicated (each holds the whole model), rank 1 writes "
        "the files (launch 3 processes)\n"
    ) in capsys.readouterr().out


def test_the_learner_rank_writes_the_files() -> None:
    spec = loads(_split("[0]", "[1]"))
    ranks = [Launch(rank=r, world_size=2, local_rank=r, timeout_s=60.0, store=object()) for r in (0, 1)]
    assert [_split_launch(spec, launched).writes_files for launched in ranks] == [False, True]  # type: ignore[union-attr]
    assert [_split_launch(loads(TINY), launched).writes_files for launched in ranks] == [True, False]  # type: ignore[union-attr]


SHAPES = next(line for line in TINY.splitlines() if line.startswith("config = "))
OTHER_MODEL = TINY.replace("[objects.run]", f'[objects.other]\nfactory = "model"\n{SHAPES}\n\n[objects.run]')


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_split().replace("[objects.trainer]", "[objects.unused]"), r"^run\.split: the step stage has no trainer; give"),
        (
            OTHER_MODEL.replace('[objects.generator]            # generate\'s generator: the learner\'s own weights\n'
                                'factory = "torch-generator"\nmodel = { object = "model" }',
                                '[objects.generator]\nfactory = "torch-generator"\nmodel = { object = "other" }')
            + "\n[run.split]\nrollout = [1]\nlearner = [0]\n",
            r"^run\.split: the generate stage's generator is a TorchGenerator over another model than the objective's; "
            r"a split's rollout ranks receive the weights into the model the objective trains",
        ),
    ],
    ids=["no-trainer", "generator-over-another-model"],
)  # fmt: skip
def test_stages_the_split_cannot_run_are_refused_before_it_starts(text: str, message: str) -> None:
    from thundersync.app.cli.split import split_parts

    assert "other" not in text or 'model = { object = "other" }' in text  # the replacement took
    spec = loads(text, ['objects.checkpointer.directory="unused"'])
    with pytest.raises(ConfigError, match=message):
        split_parts(build_graph(spec, **build_objects(spec)))


def test_the_tiny_file_with_a_placement_has_the_stages_a_split_runs() -> None:
    from thundersync.app.cli.split import split_parts

    spec = loads(_split(), ['objects.checkpointer.directory="unused"'])
    parts = split_parts(build_graph(spec, **build_objects(spec)))
    assert parts.source.config.samples == 4 and parts.params == list(parts.objective.run.params)


def _opd_split() -> str:
    from tests.app.test_deterministic_file import opd_text

    return f"{opd_text()}\n[run.split]\nrollout = [1]\nlearner = [0]\n"


def test_an_opd_file_with_a_placement_has_the_stages_a_split_runs_its_learners_the_teacher() -> None:
    """The tiny OPD file (a fake teacher, the teacher stage named ``teacher-score`` or ``teacher``)
    with a placement: the learner ranks stream into its OPD objective and score with its teacher."""
    from thundersync.app.cli.split import split_parts
    from thundersync.opd.stream import OPDStream
    from thundersync.testing import FakeTeacher

    for text in (_opd_split(), _opd_split().replace('type = "teacher-score"', 'type = "teacher"')):
        spec = loads(text, ['objects.checkpointer.directory="unused"'])
        objects = build_objects(spec)
        parts = split_parts(build_graph(spec, **objects))
        assert isinstance(parts.objective, OPDStream) and isinstance(parts.teacher, FakeTeacher)
        assert parts.teacher is objects["teacher"] and parts.params == list(parts.objective.run.params)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('stages.again={type="teacher",reads=["generate"]}', r"^run\.split: the file has 2 teacher stages "
         r"\(teacher, again\); an OPD split's learner ranks score each trajectory with one teacher: keep one "
         r"teacher-score stage$"),
        ("objects.objective.process=true", r"^objects\.objective\.process: true; the split's learner streams into "
         r"the objective in its own process \(a learner process is not built for the split\): set process = false$"),
    ],
)  # fmt: skip
def test_what_an_opd_split_does_not_run_is_refused_naming_the_key(override: str, message: str) -> None:
    from tests.app.test_deterministic_file import opd_text

    loads(opd_text(), [override])  # the same file without the split is valid
    with pytest.raises(DefinitionError, match=message):
        loads(_opd_split(), [override])


def test_a_grpo_split_with_a_teacher_stage_is_refused_before_it_starts() -> None:
    """The learner ranks score with the teacher for OPD alone; GRPO's would ignore it."""
    from thundersync.app.cli.split import split_parts

    sets = ['objects.checkpointer.directory="unused"', 'objects.teacher={factory="test-fake-teacher"}',
            'stages.teach={type="teacher-score",reads=["generate"]}']  # fmt: skip
    spec = loads(_split(), sets)
    with pytest.raises(
        ConfigError,
        match=r"^run\.split: the backward stage's objective is a RewardLinearBackward and the file has a "
        r"teacher-score stage; the learner ranks score with the teacher for OPD alone: give OPD \(factory opd\) a "
        r"teacher-score stage, and GRPO \(factory grpo\) none$",
    ):
        split_parts(build_graph(spec, **build_objects(spec)))


class _TaskScorer:
    """Scores with the task's fields, recording what it was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], list[int], dict[str, object]]] = []

    async def score_task(self, prompt_ids: list[int], completion_ids: list[int], task: dict[str, object]) -> float:
        self.seen.append((prompt_ids, completion_ids, dict(task)))
        return float(len(completion_ids)) + float(task["bonus"])  # type: ignore[arg-type]


def test_the_rollout_sampler_makes_the_generate_stages_requests_and_hands_over_each_score() -> None:
    """The seed and request of each trajectory are the generate stage's (so a split samples the
    tokens a one-process run samples); the score comes from the reward stage's scorer with the
    task's fields; a reward asked for another request than the one just generated is refused."""
    import anyio
    import msgspec

    from thundersync.app.cli.split import _Sampler
    from thundersync.errors import PipelineError
    from thundersync.events import PromptSubmitted
    from thundersync.generation.base import GenerationRequest
    from thundersync.stages.generate import GenerateStage
    from thundersync.testing import ScriptedGenerator

    generator, scorer = ScriptedGenerator(vocab_size=50), _TaskScorer()
    config = GenerateStage.Config(max_new_tokens=6, temperature=0.7, seed=11, stop_token_ids=(3,), max_context_tokens=9)
    stage = GenerateStage(config, generator=generator)
    sampler = _Sampler(stage, scorer)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    batch = [
        PromptSubmitted(group_id=g, prompt_tokens=p, num_trajectories=2, batch_id=0, task={"bonus": 10 * g})
        for g, p in enumerate(prompts)
    ]
    sampler.start(batch)
    for group, prompt in enumerate(prompts):
        for index in range(2):
            request = GenerationRequest(
                prompt_ids=prompt, params=msgspec.structs.replace(sampler.params, seed=sampler.seed(group, index))
            )
            result = anyio.run(sampler.generate, request)
            want = stage._request(group, index, 0, list(prompt))  # the stage's own request
            assert generator.requests[-1].params == want.params and generator.requests[-1].prompt_ids == prompt
            assert sampler.reward(prompt, list(result.token_ids)) == len(result.token_ids) + 10 * group
    assert [task["bonus"] for _, _, task in scorer.seen] == [0, 0, 10, 10]
    assert generator.requests[0].params.max_new_tokens == 4  # cut to the context of 9, as the stage does
    anyio.run(sampler.generate, request)
    with pytest.raises(PipelineError, match=r"asked for the reward of a request other than the one just generated"):
        sampler.reward(prompts[0], [])


def test_a_sharded_split_refuses_consolidated_checkpoints_unless_the_first_learner_is_rank_0(tmp_path: Path) -> None:
    """torch gathers a sharded model's whole state dict on rank 0 of the world alone."""
    from types import SimpleNamespace

    import torch

    from thundersync.app.checkpoints.checkpoint import Checkpointer
    from thundersync.app.cli.split import _refuse_consolidated
    from thundersync.pipeline.policy import PolicyClock

    model, sharded = torch.nn.Linear(2, 2), object()
    optimizer = torch.optim.AdamW(model.parameters())
    saver = Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=PolicyClock(), distributed=True,
                         consolidated=True, writer=True)  # fmt: skip
    saver.sharded = sharded  # type: ignore[assignment]  # what _shard_checkpointers gives it
    _refuse_consolidated({"ckpt": saver}, sharded, SimpleNamespace(source=0))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^objects\.ckpt\.consolidated: true, but the split's first learner is "
                       r"rank 1; torch gathers a sharded model's whole weights on rank 0 alone"):  # fmt: skip
        _refuse_consolidated({"ckpt": saver}, sharded, SimpleNamespace(source=1))  # type: ignore[arg-type]
    saver.consolidated = False
    _refuse_consolidated({"ckpt": saver}, sharded, SimpleNamespace(source=1))  # type: ignore[arg-type]


def _vllm_split(tmp: Path, model: str, **generator: object) -> Any:
    """The tiny split file with a LoRA model (``model``: its source, ``config = ...`` or ``path = ...``)
    and a vllm-generator over ``tmp/engine`` (a saved model of the tiny shapes) that the trainer
    publishes to, built as a learner rank builds it (``START_ENGINES`` false: no engine)."""
    from thundersync.app.factories.generators import START_ENGINES
    from thundersync.app.factories.models import model as build_model

    build_model(config=loads(TINY).objects["model"].args["config"]).save_pretrained(tmp / "engine")
    options = "".join(f"{key} = {json.dumps(value)}\n" for key, value in generator.items())
    text = (
        _split()
        .replace(SHAPES, model)
        .replace("[objects.trainer]", '[objects.trainer]\ngenerator = { object = "generator" }')
    )
    text = text.replace('generator = { object = "generator" }\n\n[stages.source]', "\n[stages.source]")
    text = text.replace(
        'factory = "torch-generator"\nmodel = { object = "model" }\nmax_batch = 32\nmax_seq_len = 64\n',
        f'factory = "vllm-generator"\nmodel = "{tmp / "engine"}"\n{options}',
    )
    spec = loads(text, ['objects.checkpointer.directory="unused"', LORA])
    token = START_ENGINES.set(False)
    try:
        objects = build_objects(spec)
    finally:
        START_ENGINES.reset(token)
    return objects, build_graph(spec, **objects)


LORA = 'objects.model.lora={r=4,lora_alpha=8,target_modules=["q_proj","v_proj"],lora_dropout=0.0}'


@pytest.mark.parametrize(
    ("source", "generator", "message"),
    [
        ("config", {"enable_lora": True}, r"^run\.split: the vllm-generator has enable_lora = true, so each rollout "
         r"rank's engine serves the adapter over its own base weights, loaded from '.*engine'; the model the objective "
         r"trains has another base \(built from its config\): load the model from that directory"),
        ("path", {"enable_lora": True, "max_lora_rank": 2}, r"^run\.split: the model's LoRA adapter has rank 4, over "
         r"the vllm-generator's max_lora_rank of 2; the engine would refuse the adapter: set max_lora_rank = 4$"),
        ("path", {"enable_lora": True}, None),  # the adapter over the directory's base: the engine's own
        ("config", {}, None),  # the merged weights, reloaded whole at each receive
    ],
    ids=["lora-over-another-base", "lora-rank-over-max", "lora-over-the-engines-base", "merged-weights"],
)  # fmt: skip
def test_a_split_learner_builds_no_vllm_engine_and_checks_what_the_engine_serves(
    tmp_path: Path, source: str, generator: dict[str, object], message: str | None
) -> None:
    """A learner rank's vllm-generator is an UnstartedEngine (no engine: it never generates) and its
    trainer a plain StreamingTrainer (nothing to publish to: the split broadcasts the weights);
    what the rollout ranks' engines could not serve is refused (decision 093)."""
    from thundersync.app.cli.split import split_parts
    from thundersync.app.factories.generators import UnstartedEngine
    from thundersync.errors import PipelineError
    from thundersync.generation import GenerationRequest, SamplingParams
    from thundersync.stages.step import StreamingTrainer

    model = SHAPES if source == "config" else f'path = "{tmp_path / "engine"}"'
    objects, graph = _vllm_split(tmp_path, model, **generator)
    assert isinstance(objects["generator"], UnstartedEngine) and type(objects["trainer"]) is StreamingTrainer
    if message is not None:
        with pytest.raises(ConfigError, match=message):
            split_parts(graph)
        return
    assert split_parts(graph).generate.generator is objects["generator"]
    with pytest.raises(PipelineError, match=r"^a split's learner rank started no vLLM engine \(vllm-generator\)"):
        anyio.run(objects["generator"].generate, GenerationRequest(prompt_ids=[1], params=SamplingParams()))


def test_a_rollout_ranks_engine_of_other_shapes_than_the_model_is_refused() -> None:
    """``sync_from`` loads the trained model's weights into the engine: its shapes must be the model's
    (the started engine's ``hf_config``, as ``VLLMGenerator.llm`` holds it, against the model's config)."""
    from types import SimpleNamespace

    from thundersync.app.cli.split import _check_shapes
    from thundersync.app.factories.models import model as build_model

    model = build_model(config=loads(TINY).objects["model"].args["config"])
    config = SimpleNamespace(**{**model.config.to_dict(), "hidden_size": 64})
    engine = SimpleNamespace(model="/models/other", llm=SimpleNamespace(llm_engine=SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config))))  # fmt: skip
    with pytest.raises(ConfigError, match=r"^run\.split: the vllm-generator's model '/models/other' has hidden_size "
                       r"= 64, the model the objective trains 32; each receive loads that model's weights"):  # fmt: skip
        _check_shapes(engine, model)
    config.hidden_size = 32
    _check_shapes(engine, model)  # the same shapes
