"""Events round-trip through JSON and MessagePack unchanged; bad input raises EventError naming the field."""

from __future__ import annotations

import sys

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given
from hypothesis import strategies as st

from thundersync import events
from thundersync.errors import EventError
from thundersync.events import ActionGenerated, Event, PolicyPublished, Rewarded

ids = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.text(max_size=8))
finite = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def action_generated(draw: st.DrawFn) -> ActionGenerated:
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), max_size=16))
    return ActionGenerated(
        group_id=draw(ids),
        trajectory_id=draw(ids),
        turn=draw(st.integers(0, 100)),
        token_ids=tokens,
        behaviour_logprobs=draw(st.lists(finite, min_size=len(tokens), max_size=len(tokens))),
        scored=draw(st.lists(st.booleans(), min_size=len(tokens), max_size=len(tokens))),
        final=draw(st.booleans()),
        stop_reason=draw(st.none() | st.sampled_from(["context", "submitted", "failed", "dropped"])),
    )


def _strategy(info: mi.Type) -> st.SearchStrategy[object]:
    """A strategy for any value that msgspec would accept for a field of this type."""
    if isinstance(info, mi.IntType):
        low = -(2**63) if info.ge is None else info.ge
        high = info.le if info.le is not None else (2**63 if info.lt is None else info.lt) - 1
        return st.integers(min_value=low, max_value=high)
    if isinstance(info, mi.FloatType):
        return finite
    if isinstance(info, mi.StrType):
        return st.text(max_size=8)
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.LiteralType):
        return st.sampled_from(info.values)
    if isinstance(info, mi.ListType):
        return st.lists(_strategy(info.item_type), max_size=8)
    if isinstance(info, mi.UnionType):
        return st.one_of([_strategy(t) for t in info.types])
    if isinstance(info, mi.DictType):
        return st.dictionaries(_strategy(info.key_type), _strategy(info.value_type), max_size=4)
    if isinstance(info, mi.AnyType):  # a JSON value (task fields)
        scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | finite | st.text(max_size=8)
        return st.recursive(
            scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
        )
    raise NotImplementedError(f"no strategy for {info}")


def _builds(cls: type[events.EventBase]) -> st.SearchStrategy[events.EventBase]:
    if cls is ActionGenerated:  # its lists must have equal lengths
        return action_generated()
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return st.builds(cls, **{field.name: _strategy(field.type) for field in info.fields})


any_event = st.one_of([_builds(cls) for cls in events.EVENT_TYPES.values()])


@given(any_event)
def test_every_event_round_trips_through_json_unchanged(event: events.EventBase) -> None:
    assert events.decode_json(events.encode_json(event)) == event


@given(any_event)
def test_every_event_round_trips_through_msgpack_unchanged(event: events.EventBase) -> None:
    assert events.decode_msgpack(events.encode_msgpack(event)) == event


def test_the_union_covers_every_event_class() -> None:
    assert set(events.EVENT_TYPES) == {cls.__name__ for cls in Event.__args__}  # type: ignore[attr-defined]
    assert {
        "GroupOpened",
        "ActionGenerated",
        "ToolObserved",
        "TeacherScored",
        "Rewarded",
        "TrajectoryClosed",
        "GroupClosed",
        "BatchReady",
        "StepDone",
        "PolicyPublished",
    } <= set(events.EVENT_TYPES)


def test_the_type_tag_is_the_class_name() -> None:
    encoded = events.encode_json(Rewarded(group_id=1, trajectory_id="a", reward=0.5))
    assert msgspec.json.decode(encoded)["type"] == "Rewarded"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            b'{"type":"ActionGenerated","group_id":1,"trajectory_id":1,"turn":"x","token_ids":[]}',
            r"Expected `int`, got `str` - at `\$.turn`",
        ),
        (
            b'{"type":"ActionGenerated","group_id":1,"trajectory_id":1,"turn":0,"token_ids":[-1]}',
            r"at `\$.token_ids\[0\]`",
        ),
        (
            b'{"type":"ActionGenerated","group_id":1,"trajectory_id":1,"turn":0,"token_ids":[1],"scored":[true,false]}',
            r"`scored` has 2 entries but `token_ids` has 1",
        ),
        (b'{"type":"Rewarded","group_id":1,"trajectory_id":1}', r"missing required field `reward`"),
        (b'{"type":"Rewarded","group_id":1,"trajectory_id":1,"reward":1,"rewrd":2}', r"unknown field `rewrd`"),
        (b'{"type":"Rewardd","group_id":1}', r"Invalid value 'Rewardd' - at `\$.type`"),
    ],
)
def test_malformed_input_raises_an_event_error_naming_the_field(payload: bytes, message: str) -> None:
    with pytest.raises(EventError, match=r"^invalid JSON event: .*" + message):
        events.decode_json(payload)
    with pytest.raises(EventError, match=r"^invalid MessagePack event: .*" + message):
        events.decode_msgpack(msgspec.msgpack.encode(msgspec.json.decode(payload)))


def test_input_that_is_not_json_raises_an_event_error() -> None:
    with pytest.raises(EventError, match=r"^invalid JSON event: (JSON is malformed|Input data was truncated)"):
        events.decode_json(b'{"type":"Rewarded",')


def test_events_are_frozen() -> None:
    event = Rewarded(group_id=1, trajectory_id=2, reward=1.0)
    with pytest.raises(AttributeError):
        event.reward = 2.0  # type: ignore[misc]


def test_non_finite_log_probs_are_rejected_naming_the_entry() -> None:
    payload = {
        "type": "TeacherScored",
        "group_id": 1,
        "trajectory_id": 1,
        "turn": 0,
        "teacher_logprobs": [-0.5, float("inf")],
    }
    with pytest.raises(EventError, match=r"`teacher_logprobs\[1\]` is inf, expected a finite float"):
        events.decode_msgpack(msgspec.msgpack.encode(payload))


def test_a_deeply_nested_value_before_the_tag_raises_an_event_error_not_a_recursion_error() -> None:
    depth = sys.getrecursionlimit() + 100  # deeper than Python allows (an earlier test may have raised it)
    deep = "[" * depth + "]" * depth
    payload = '{"x":' + deep + ',"type":"PolicyPublished","policy_version":1}'
    with pytest.raises(EventError, match=r"^invalid JSON event: the input is nested too deeply to decode"):
        events.decode_json(payload)
    packed = b"\x82" + msgspec.msgpack.encode("x") + b"\x91" * depth + b"\x90"
    packed += msgspec.msgpack.encode("type") + msgspec.msgpack.encode("PolicyPublished")
    with pytest.raises(EventError, match=r"^invalid MessagePack event: the input is nested too deeply to decode"):
        events.decode_msgpack(packed)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("token_ids", [2**64 + 1], r"Expected `int` <= 2147483647 - at `\$.token_ids\[0\]`"),
        ("token_ids", [2**31], r"Expected `int` <= 2147483647 - at `\$.token_ids\[0\]`"),
        ("turn", 2**64, r"Expected `int` <= 9223372036854775807 - at `\$.turn`"),
        ("group_id", -(2**64), r"Expected `int` >= -9223372036854775808 - at `\$.group_id`"),
        ("policy_version", -1, r"Expected `int` >= 0 - at `\$.policy_version`"),
    ],
)
def test_integers_outside_their_range_are_rejected_by_the_schema(field: str, value: object, message: str) -> None:
    payload = {"type": "ActionGenerated", "group_id": 0, "trajectory_id": 0, "turn": 0, "token_ids": [1]}
    payload[field] = value
    with pytest.raises(EventError, match=message):
        events.decode_json(msgspec.json.encode(payload))


def test_every_event_that_decodes_from_json_also_encodes_as_msgpack() -> None:
    event = events.decode_json(b'{"type":"ActionGenerated","group_id":0,"trajectory_id":0,"turn":0,"token_ids":[0]}')
    assert events.decode_msgpack(events.encode_msgpack(event)) == event


def test_an_unvalidated_int_past_64_bits_fails_to_encode_with_an_event_error() -> None:
    with pytest.raises(EventError, match=r"^PolicyPublished cannot be encoded as MessagePack: .*must fit 64 bits"):
        events.encode_msgpack(PolicyPublished(policy_version=2**64))
