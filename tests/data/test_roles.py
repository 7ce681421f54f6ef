"""Field roles (data/roles.py): declared on the field, every derived set read from the classes."""

from __future__ import annotations

import dataclasses

from data import roles
from data.roles import ARGUMENT, CADENCE, LAYOUT, LOCATION, RUNTIME, field
from data.strict import to_dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    lr: float = field(0.1, role=ARGUMENT)
    folder: str = field("", role=RUNTIME)
    width: int = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    inner: Inner = Inner()
    every: int = field(10, role=CADENCE)
    shards: int = field(1, role=LAYOUT, identity_default=1, plan_input="shard_count")
    path: str = field("", role=LOCATION)
    added: tuple[str, ...] = field(("x",), identity_default=())
    section: Inner = field(Inner(width=2), identity_default=Inner(width=2))


def test_paths_select_by_what_a_role_answers():
    assert roles.roles(Outer)["inner.lr"] is ARGUMENT
    assert roles.roles(Outer)["inner.width"] is roles.SEMANTIC
    assert roles.paths(Outer, resume_free=True) == {
        "inner.folder",
        "every",
        "shards",
        "section.folder",
    }
    assert roles.paths(Outer, program=False) == {"inner.lr", "every", "section.lr"}
    assert roles.paths(Outer, identity=False) == {
        "inner.folder",
        "every",
        "path",
        "section.folder",
    }
    assert roles.paths(Outer, identity=True, resume_free=True) == {"shards"}
    assert roles.plan_inputs(Outer) == {"shard_count": "shards"}


def test_identity_view_drops_what_identity_ignores_and_keeps_the_rest():
    d = to_dict(Outer(shards=4, added=()))
    view = roles.identity_view(Outer, d)
    assert view == {"inner": {"lr": 0.1, "width": 8}, "shards": 4}
    assert d["every"] == 10  # the input is left as it was
    # Off their identity defaults, fields count: a whole section is compared before its fields.
    d = to_dict(Outer(added=("y",), section=Inner(width=3, folder="/f")))
    view = roles.identity_view(Outer, d)
    assert view == {
        "inner": {"lr": 0.1, "width": 8},
        "added": ["y"],
        "section": {"lr": 0.1, "width": 3},
    }


def test_identity_view_of_a_config_recorded_before_and_after_a_field():
    new = to_dict(Outer())
    old = {k: v for k, v in new.items() if k not in ("added", "shards")}
    old["retired"] = "kept"  # a key no field has any more: hashed as it was
    assert roles.identity_view(Outer, old) == {"inner": {"lr": 0.1, "width": 8}, "retired": "kept"}
    assert roles.identity_view(Outer, new) == {"inner": {"lr": 0.1, "width": 8}, "added": ["x"]}


def test_identity_default_is_its_own_value_not_the_default():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Changed:
        mode: str = field("new", identity_default="old")

    assert roles.identity_view(Changed, {"mode": "old"}) == {}
    assert roles.identity_view(Changed, {"mode": "new"}) == {"mode": "new"}
