"""References inside an argument's tables and arrays: built first, replaced in place, checked, cycles named."""

from __future__ import annotations

from pathlib import Path

import pytest

from thundersync.app.files.build import build_objects
from thundersync.app.files.check import check_pipeline
from thundersync.app.files.definition import loads
from thundersync.app.files.object_graph import build_order
from thundersync.errors import DefinitionError

TINY = (Path(__file__).resolve().parents[3] / "examples" / "train_tiny_grpo.toml").read_text()
NESTED = TINY.replace('generator = { object = "generator" }\n', 'rngs = { sampler = { object = "generator" } }\n')


def test_a_reference_inside_a_table_is_built_first_and_replaced_by_its_object() -> None:
    spec = loads(NESTED)
    assert spec.objects["checkpointer"].refs["rngs.sampler"] == "generator"
    order = build_order(spec)
    assert order.index("generator") < order.index("checkpointer")
    built = build_objects(spec)
    assert built["checkpointer"].rngs == {"sampler": built["generator"]}


def test_a_nested_reference_to_the_wrong_kind_of_object_is_refused_by_check() -> None:
    spec = loads(NESTED.replace('sampler = { object = "generator" }', 'sampler = { object = "optimizer" }'))
    with pytest.raises(
        DefinitionError,
        match=r"^objects.checkpointer.rngs.sampler: references 'optimizer', a 'optimizer' object that makes a "
        r"Optimizer, but this field takes a RandomSource",
    ):
        check_pipeline(spec)


def test_an_unknown_nested_reference_names_its_path() -> None:
    spec = loads(NESTED.replace('sampler = { object = "generator" }', 'sampler = { object = "genrator" }'))
    with pytest.raises(
        DefinitionError, match=r"^objects.checkpointer.rngs.sampler: references 'genrator', which is not"
    ):
        check_pipeline(spec)


def test_a_cycle_through_an_array_is_named_with_the_item_path() -> None:
    # an optimizer passes unknown fields on to torch (**options), so a reference may sit in one
    spec = loads(TINY.replace('name = "AdamW"', 'name = "AdamW"\nextra = [1, { object = "checkpointer" }]'))
    assert spec.objects["optimizer"].refs == {"objective": "objective", "extra[1]": "checkpointer"}
    with pytest.raises(
        DefinitionError,
        match=r"^objects form a cycle: objects.optimizer.extra\[1\] -> objects.checkpointer.optimizer -> objects.optimizer;",
    ):
        check_pipeline(spec)


def test_a_reference_where_a_typed_value_belongs_fails_at_load_naming_its_place() -> None:
    with pytest.raises(DefinitionError, match=r"^objects.schedule.warmup_steps: takes a value, not a reference"):
        loads(TINY.replace("warmup_steps = 1", 'warmup_steps = { object = "model" }'))
    with pytest.raises(DefinitionError, match=r"^objects.schedule.warmup_steps: Expected `int`, got `array`"):
        loads(TINY.replace("warmup_steps = 1", 'warmup_steps = [{ object = "model" }]'))
