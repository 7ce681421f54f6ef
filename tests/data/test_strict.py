"""The strict dataclass loader (data/strict.py) that run configs and feature specs share."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from data import strict
from data.strict import FieldError


class MyError(ValueError):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class Leaf:
    n: int = 1
    kind: Literal["a", "b"] = "a"
    pair: tuple[float, float] | None = None

    def __post_init__(self):
        if self.n < 0:
            raise MyError(f"n must be >= 0, got {self.n}")
        if self.n == 99:
            raise ValueError("n: 99 is reserved")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Root:
    name: str
    rate: float = 0.5
    on: bool = False
    leaves: tuple[Leaf, ...] = ()
    files: tuple[str, ...] = ()


def test_round_trip_rebuilds_tuples_and_nested_dataclasses():
    root = Root(name="r", rate=2.0, leaves=(Leaf(n=3, kind="b", pair=(1.0, 2.0)), Leaf()))
    d = strict.to_dict(root)
    assert d["leaves"][0]["pair"] == [1.0, 2.0] and isinstance(d["leaves"], list)
    assert strict.build(Root, d) == root
    assert strict.build(Root, {"name": "r", "rate": 2}).rate == 2.0  # an integer is a number


@pytest.mark.parametrize(
    "data, message",
    [
        ({"name": "r", "rat": 1.0}, r"^cfg: unknown field 'rat' \(known: name, rate, on, "),
        ({}, r"^cfg: missing field 'name'$"),
        ({"name": 3}, r"^cfg\.name: expected a string, got 3$"),
        ({"name": "r", "on": "yes"}, r"^cfg\.on: expected true or false, got 'yes'$"),
        ({"name": "r", "rate": True}, r"^cfg\.rate: expected a number, got True$"),
        ({"name": "r", "leaves": [{"n": True}]}, r"^cfg\.leaves\[0\]\.n: expected an integer"),
        ({"name": "r", "leaves": [{"kind": "c"}]}, r"leaves\[0\]\.kind: 'c' is not one of \['a'"),
        ({"name": "r", "leaves": [{"pair": [1]}]}, r"leaves\[0\]\.pair: expected 2 values, got 1"),
        ({"name": "r", "leaves": [3]}, r"leaves\[0\]: expected a mapping for Leaf, got 3$"),
        ({"name": "r", "files": "a.csv"}, r"^cfg\.files: expected a list, got 'a.csv'$"),
    ],
)
def test_errors_name_the_field_path(data, message):
    with pytest.raises(FieldError, match=message):
        strict.build(Root, data, path="cfg")


def test_field_error_is_a_type_error_and_a_value_error():
    # Run configs raised TypeError for an unknown field and ValueError for a bad literal.
    for data in ({"name": "r", "x": 1}, {"name": "r", "leaves": [{"kind": "c"}]}):
        with pytest.raises(TypeError):
            strict.build(Root, data)
        with pytest.raises(ValueError):
            strict.build(Root, data)


def test_the_callers_error_class_and_the_post_init_errors():
    with pytest.raises(MyError, match=r"^unknown field 'x'"):
        strict.build(Root, {"name": "r", "x": 1}, error=MyError)
    # A post-init error of the caller's class gets the failing dataclass's path ...
    with pytest.raises(MyError, match=r"^leaves\[1\]: n must be >= 0, got -1$"):
        strict.build(Root, {"name": "r", "leaves": [{}, {"n": -1}]}, error=MyError)
    # ... others pass as they are (their messages name their fields).
    with pytest.raises(ValueError, match=r"^n: 99 is reserved$"):
        strict.build(Root, {"name": "r", "leaves": [{"n": 99}]}, error=MyError)


def test_str_as_list_reads_one_string_as_a_list_of_it():
    root = strict.build(Root, {"name": "r", "files": "a.csv"}, str_as_list=True)
    assert root.files == ("a.csv",)
