"""cas.record: the frozen, slotted records behave as ``@dataclass(frozen=True, slots=True)`` does for our use."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from typing import Any

import pytest

from cas.record import FrozenRecordError, field, fields, record, replace


@record
class Point:
    """A point."""

    x: int
    y: int = 0
    tags: dict[str, Any] = field(default_factory=dict)
    note: str | None = field(default=None, compare=False, repr=False)

    @property
    def norm1(self) -> int:
        return abs(self.x) + abs(self.y)


@dataclasses.dataclass(frozen=True, slots=True)
class DPoint:
    x: int
    y: int = 0
    tags: dict[str, Any] = dataclasses.field(default_factory=dict)
    note: str | None = dataclasses.field(default=None, compare=False, repr=False)


def test_init_defaults_factory_and_keywords() -> None:
    p, q = Point(1), Point(1)
    assert (p.x, p.y, p.tags, p.note) == (1, 0, {}, None)
    assert p.tags is not q.tags  # a fresh default per instance
    assert Point(x=2, y=3, tags={"a": 1}, note="n").tags == {"a": 1}
    assert Point(1, 2).norm1 == 3 and Point.__doc__ == "A point."
    with pytest.raises(TypeError):
        Point()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Point(1, 2, {}, None, 5)  # type: ignore[call-arg]


def test_frozen_slotted_eq_hash_repr_like_a_dataclass() -> None:
    p = Point(1, 2, note="ignored in eq and repr")
    with pytest.raises(FrozenRecordError):
        p.x = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del p.y  # type: ignore[misc]
    with pytest.raises(AttributeError):
        p.other = 1  # type: ignore[attr-defined]
    assert not hasattr(p, "__dict__")
    assert p == Point(1, 2, note="other") and p != Point(1, 3) and p != DPoint(1, 2)
    assert repr(p).replace("Point", "DPoint") == repr(DPoint(1, 2))
    assert hash(Point(1, 2, tags=None)) == hash(Point(1, 2, tags=None, note="x"))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        hash(p)  # a dict field is unhashable, as with a dataclass
    assert fields(p) == ("x", "y", "tags", "note") == tuple(f.name for f in dataclasses.fields(DPoint))


def test_replace_and_pickle() -> None:
    p = Point(1, 2, tags={"k": "v"}, note="n")
    r = replace(p, y=5)
    assert (r.x, r.y, r.tags, r.note) == (1, 5, {"k": "v"}, "n") and p.y == 2
    with pytest.raises(TypeError):
        replace(p, z=1)
    back = pickle.loads(pickle.dumps(p))
    assert back == p and back.note == "n"


def test_misuse_is_refused() -> None:
    with pytest.raises(TypeError):
        @record
        class Bad:
            a: int = 1
            b: int

    @record
    class Base:
        a: int

    with pytest.raises(TypeError):
        @record
        class Child(Base):
            b: int
    with pytest.raises(ValueError):
        field(default=1, default_factory=list)


def test_a_cli_replay_path_does_not_import_dataclasses() -> None:
    """The point of the module: the records on a replay's path cost no dataclasses import."""
    code = ("import sys, patcher.protocol, patcher.cli; "
            "print('dataclasses' in sys.modules, 'inspect' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"], out
