"""Prepared data and its inputs as an attacker or a careless user would give them: a planted
pickle in a prepared folder, a spec whose name escapes the prepared-data root, an unbounded
``max_hotness``, invalid UTF-8, quoted line breaks and an oversized header in a CSV file."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from data.tabular import SpecError, TabularFormatError, load_spec, prepare
from data.tabular.encode import Counts
from data.tabular.prepare import prepared_folder
from data.tabular.spec import MAX_HOTNESS, spec_from_dict

HEADER = "label,u,x\n"
GOOD = "1,a,1\n0,b,2.5\n1,c,3\n0,a,4\n"  # lines 2-5


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)
    return path


def _spec(base: Path, files, **extra):
    fields = {
        "train": files,
        "split": {"kind": "random", "valid_fraction": 0.0},
        "label": {"column": "label"},
        "features": [{"name": "u", "kind": "categorical"}, {"name": "x", "kind": "numeric"}],
    }
    return spec_from_dict({**fields, **extra}, where="test-spec", base_dir=str(base))


def _prepare(spec, base: Path, root: str = "prep"):
    return prepare(spec, str(base / root), workers=1, progress=False)


def _train(p):
    src = p.records("train")
    return p.to_batch([src[i] for i in range(len(src))])


def _same(a, b) -> None:
    assert a.schema == b.schema and a.stats["rows"] == b.stats["rows"]
    for t, v in a.vocab.values.items():
        assert (v is None) == (b.vocab.values[t] is None)
        if v is not None:
            assert v.equals(b.vocab.values[t])
    for x, y in zip(_train(a), _train(b), strict=True):
        np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------- count files


class _Planted:
    """A pickle that creates a folder when it is loaded (a stand-in for any code)."""

    def __init__(self, flag: str):
        self.flag = flag

    def __reduce__(self):
        return (os.mkdir, (self.flag,))


def test_a_planted_pickle_in_count_is_never_loaded(tmp_path):
    _write(tmp_path / "d.csv", HEADER + GOOD)
    spec = _spec(tmp_path, ["d.csv"])
    clean = _prepare(spec, tmp_path, "clean")
    folder, _ = prepared_folder(spec, str(tmp_path / "prep"))
    flag = tmp_path / "the-pickle-ran"
    # Named as the old version's count marker of the only part, so the part looks counted.
    _write(Path(folder) / "count" / "f00000-c0000-p000000.pkl", pickle.dumps(_Planted(str(flag))))
    p = _prepare(spec, tmp_path)
    assert not flag.exists()
    assert sorted(os.listdir(Path(folder) / "count")) == [
        "f00000-c0000-p000000.arrow",
        "f00000-c0000-p000000.pkl",
    ]
    _same(clean, p)


def test_counts_round_trip_exactly_and_a_bad_count_file_is_one_line(tmp_path):
    c = Counts(
        tables={
            "s": pa.table({"values": ["b", "a", "é"], "counts": pa.array([3, 1, 2], pa.int64())}),
            "i": pa.table({"values": pa.array([-5, 7], pa.int64()), "counts": [1, 9]}),
            "h": pa.table({"values": pa.array([2**64 - 1], pa.uint64()), "counts": [4]}),
            "e": pa.table(
                {"values": pa.array([], pa.string()), "counts": pa.array([], pa.int64())}
            ),
        },
        moments={"x": (3.0, 1 / 3, 2.000000000000001)},
        rows=[5, 1, 0],
        positives=[2.0, 0.5, 0.0],
    )
    path = _write(tmp_path / "c.arrow", c.to_bytes())
    back = Counts.load(str(path))
    assert list(back.tables) == list(c.tables)
    for t, tbl in c.tables.items():
        assert back.tables[t].equals(tbl), t
    assert back.moments == c.moments and back.rows == c.rows and back.positives == c.positives

    for bad in (b"", pickle.dumps(c), c.to_bytes()[:-40]):
        _write(path, bad)
        with pytest.raises(ValueError, match="^" + re.escape(f"{path}: not a counts file")):
            Counts.load(str(path))

    # In a preparation: one line naming the file and what to do.
    _write(tmp_path / "d.csv", HEADER + GOOD)
    spec = _spec(tmp_path, ["d.csv"])
    folder, _ = prepared_folder(spec, str(tmp_path / "prep"))
    _write(Path(folder) / "count" / "f00000-c0000-p000000.arrow", b"ARROW1 not really")
    with pytest.raises(TabularFormatError, match=r"p000000\.arrow: not a counts file .*prepare"):
        _prepare(spec, tmp_path)


# ----------------------------------------------------------------------------- spec fields

BAD_NAMES = ["../../x", "/tmp/x", "a/b", "..", ".", "", "a\\b", "a\nb", "n" * 201]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_spec_name_that_is_not_one_folder_name_is_an_error(tmp_path, name):
    fields = {
        "name": name,
        "train": ["d.csv"],
        "label": {"column": "label"},
        "features": [{"name": "u", "kind": "categorical"}],
    }
    path = _write(tmp_path / "spec.json", json.dumps(fields))
    with pytest.raises(SpecError, match="^" + re.escape(f"{path}: name: ") + ".*plain folder name"):
        load_spec(path)


def test_plain_names_are_kept(tmp_path):
    for name in ("tabular", "movies-2024.v1", "my data", "données", "a..b", "n" * 200):
        spec = _spec(tmp_path, ["d.csv"], name=name)
        assert spec.name == name
    _write(tmp_path / "d.csv", HEADER + GOOD)
    p = _prepare(_spec(tmp_path, ["d.csv"], name="my data"), tmp_path)
    assert Path(p.folder).parent == tmp_path / "prep" and Path(p.folder).name.startswith("my data-")


def test_max_hotness_is_bounded_naming_the_field(tmp_path):
    bag = {"name": "t", "kind": "multi_categorical", "max_hotness": MAX_HOTNESS}
    assert _spec(tmp_path, ["d.csv"], features=[bag]).features[0].max_hotness == MAX_HOTNESS
    text = (
        "train: [d.csv]\nlabel: {column: label}\nfeatures:\n  - {name: u, kind: categorical}\n"
        f"  - {{name: t, kind: multi_categorical, max_hotness: {MAX_HOTNESS + 1}}}\n"
    )
    path = _write(tmp_path / "spec.yaml", text)
    want = f"{path}: features[1]: feature 't': max_hotness {MAX_HOTNESS + 1} is above {MAX_HOTNESS}"
    with pytest.raises(SpecError, match="^" + re.escape(want)):
        load_spec(path)
    path = _write(tmp_path / "spec.yaml", text.replace(str(MAX_HOTNESS + 1), str(10**12)))
    with pytest.raises(SpecError, match=r"features\[1\]: .*max_hotness 1000000000000 is above"):
        load_spec(path)
