"""Objects that reference objects: order, cycles, unknown references, types; check builds nothing; --set."""

from __future__ import annotations

from pathlib import Path

import pytest

from thundersync.app.cli.command import main
from thundersync.app.factories import models
from thundersync.app.files.build import build_graph, build_objects
from thundersync.app.files.check import check_pipeline
from thundersync.app.files.definition import ObjectSpec, PipelineSpec, load, loads
from thundersync.app.files.object_graph import build_order
from thundersync.errors import DefinitionError
from thundersync.tools.base import ByteTokenizer
from thundersync.tools.qwen import Qwen3ToolCallParser

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "train_tiny_grpo.toml"

PARSER_FIRST = """\
[objects.parser]
factory = "qwen3-tool-calls"
tokenizer = { object = "tok" }
[objects.tok]
factory = "tokenizer"
builtin = "bytes"
[stages.source]
type = "source"
prompts = [[1]]
"""


def test_a_reference_is_built_first_and_passed_as_the_object() -> None:
    spec = loads(PARSER_FIRST)
    assert spec.objects["parser"].refs == {"tokenizer": "tok"} and spec.objects["parser"].args == {}
    assert build_order(spec) == ["tok", "parser"]
    built = build_objects(spec)
    assert isinstance(built["tok"], ByteTokenizer) and isinstance(built["parser"], Qwen3ToolCallParser)
    assert built["parser"].tokenizer is built["tok"]


def test_a_given_object_satisfies_a_reference() -> None:
    spec = loads(PARSER_FIRST.replace('"tok" }', '"mine" }'))
    mine = ByteTokenizer()
    assert build_objects(spec, mine=mine)["parser"].tokenizer is mine


@pytest.mark.parametrize(
    ("tables", "path"),
    [
        ({"a": "b", "b": "a"}, "objects.a.tokenizer -> objects.b.tokenizer -> objects.a"),
        ({"a": "a"}, "objects.a.tokenizer -> objects.a"),
        ({"x": "a", "a": "b", "b": "c", "c": "a"}, "objects.a.tokenizer -> objects.b.tokenizer -> objects.c.tokenizer"),
    ],
)
def test_a_cycle_of_references_is_refused_naming_its_path(tables: dict[str, str], path: str) -> None:
    text = "".join(
        f'[objects.{name}]\nfactory = "qwen3-tool-calls"\ntokenizer = {{ object = "{target}" }}\n'
        for name, target in tables.items()
    )
    spec = loads(text + '[stages.source]\ntype = "source"\nprompts = [[1]]\n')
    with pytest.raises(DefinitionError, match=f"^objects form a cycle: {path}"):
        check_pipeline(spec)


def test_an_unknown_reference_names_the_field_and_the_known_objects() -> None:
    spec = loads(PARSER_FIRST.replace('"tok" }', '"tokenizr" }'))
    with pytest.raises(
        DefinitionError,
        match="^objects.parser.tokenizer: references 'tokenizr', which is not an object of the file; objects: parser, tok$",
    ):
        check_pipeline(spec)


def test_a_reference_to_the_wrong_kind_of_object_is_refused_by_check() -> None:
    text = '[objects.clock]\nfactory = "policy-clock"\n[objects.run]\nfactory = "streaming-run"\n'
    text += 'model = { object = "clock" }\n[stages.source]\ntype = "source"\nprompts = [[1]]\n'
    with pytest.raises(DefinitionError, match=r"^objects.run.model: references 'clock', a 'policy-clock' object that "):
        check_pipeline(loads(text))


def test_a_stage_object_of_the_wrong_kind_is_refused_by_check() -> None:
    text = TINY.read_text().replace(
        '[stages.step]\ntype = "step"', '[stages.step]\ntype = "step"\nobjects = { trainer = "policy" }'
    )
    with pytest.raises(
        DefinitionError, match="^stages.step.objects.trainer: references 'policy', a 'policy-clock' object"
    ):
        check_pipeline(loads(text))


def test_a_reference_where_a_value_belongs_and_a_missing_reference_are_refused() -> None:
    with pytest.raises(DefinitionError, match="^objects.model.seed: takes a value, not a reference to an object$"):
        loads(TINY.read_text().replace("seed = 0", 'seed = { object = "run" }'))
    with pytest.raises(DefinitionError, match=r"^objects.run.model: missing required field \(a reference to another"):
        loads(TINY.read_text().replace('model = { object = "model" }\n\n[objects.objective]', "\n[objects.objective]"))
    with pytest.raises(DefinitionError, match=r"^objects.run.modl: unknown field; valid fields: factory, "):
        loads(
            TINY.read_text().replace(
                'model = { object = "model" }\n\n[objects.objective]',
                'modl = { object = "model" }\n[objects.objective]',
            )
        )


def test_check_validates_the_whole_file_without_building_any_object(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("check must not build the model")

    monkeypatch.setattr(models, "_from_config", no_weights)
    assert main(["check", str(TINY)]) == 0
    assert capsys.readouterr().out.startswith(f"{TINY}: ok, 6 stages, 10 runtime objects\n")
    with pytest.raises(AssertionError, match="check must not build the model"):
        build_graph(load(TINY))  # run does build it


def test_set_overrides_fields_of_any_table() -> None:
    spec = load(
        TINY,
        [
            "run.timeout_s=60",
            'objects.model.dtype="float64"',
            "objects.model.device=cpu",  # not a TOML value: a plain string
            "stages.source.samples=8",
            "objects.optimizer.lr=1e-2",
            "objects.model.config.hidden_size=64",  # inside an inline table
            'objects.model.lora={ r = 4, target_modules = ["q_proj"] }',  # a field the file leaves unset
        ],
    )
    assert spec.objects["model"].args["config"]["hidden_size"] == 64
    assert spec.objects["model"].args["lora"] == {"r": 4, "target_modules": ["q_proj"]}
    assert spec.run.timeout_s == 60
    assert spec.objects["model"].args["dtype"] == "float64" and spec.objects["model"].args["device"] == "cpu"
    assert spec.stages["source"].config.samples == 8  # type: ignore[union-attr]  # a SourceStage.Config
    assert spec.objects["optimizer"].args["lr"] == 1e-2


def test_set_refuses_a_path_the_file_does_not_have() -> None:
    with pytest.raises(DefinitionError, match=r"--set 'stages.sorce.samples=8': the file has no table stages.sorce;"):
        load(TINY, ["stages.sorce.samples=8"])
    with pytest.raises(DefinitionError, match="stages.source.sampels: unknown field; valid fields: "):
        load(TINY, ["stages.source.sampels=8"])
    with pytest.raises(DefinitionError, match=r"--set 'samples': expected key.path=value"):
        load(TINY, ["samples"])
    with pytest.raises(DefinitionError, match="objects.model.dtype: Expected `str`, got `int`"):
        load(TINY, ["objects.model.dtype=16"])


def test_set_on_the_command_line_is_repeatable_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(TINY), "--set", "stages.source.samples=2", "--set", "run.timeout_s=5"]) == 0
    assert main(["check", str(TINY), "--set", "objects.nothing.x=1"]) == 2
    assert "the file has no table objects.nothing" in capsys.readouterr().err


def test_a_spec_built_in_python_with_an_unknown_factory_is_refused_by_name() -> None:
    spec = PipelineSpec(stages={}, objects={"m": ObjectSpec("modle")})
    with pytest.raises(DefinitionError, match="^objects.m.factory: unknown factory 'modle'; known: model, "):
        build_objects(spec)
