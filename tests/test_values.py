"""`appserver.values.value`: immutable to the type checker (mypy flags assignments, as for a frozen
dataclass), and at run time a slotted record compared and hashed by its fields."""

from __future__ import annotations

import dataclasses

from appserver.providers.base import Text
from appserver.runtime import TurnSnapshot
from appserver.values import value


@value
class Point:
    x: int
    tags: tuple[str, ...] = ()
    extra: dict[str, int] = dataclasses.field(default_factory=dict, compare=False, hash=False)


def test_value_records_compare_and_hash_by_their_fields() -> None:
    a, b = Point(1, ("t",)), Point(1, ("t",))
    assert a == b and hash(a) == hash(b) and len({a, b, Point(2)}) == 2
    assert a.extra == {} and a.extra is not b.extra
    assert not hasattr(a, "__dict__")  # slotted
    assert dataclasses.replace(a, x=3) == Point(3, ("t",))
    assert Text("hi") == Text("hi") and hash(Text("hi")) == hash(Text("hi")) and Text("hi") != Text("ho")


def test_the_hot_records_are_value_classes() -> None:
    """The records built per request (provider chunks, snapshots) pay no frozen __init__."""
    for cls in (Text, TurnSnapshot):
        assert dataclasses.is_dataclass(cls) and not cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert "__slots__" in cls.__dict__
