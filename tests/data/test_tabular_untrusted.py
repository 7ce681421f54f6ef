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


# ----------------------------------------------------------------------------- CSV rows


def _rejects(p) -> list[list[str]]:
    """The rejects files' records: [file, line, reason, column, text]."""
    text = "".join(f.read_text() for f in sorted((Path(p.folder) / "rejects").glob("*.tsv")))
    return [line.split("\t", 4) for line in text.splitlines() if not line.startswith("file\t")]


def _clean_equal(p, tmp_path: Path, kept: str, **extra) -> None:
    """The kept rows encode as a file of only those rows (strict), vocabulary included."""
    _write(tmp_path / "clean" / "d.csv", kept)
    _same(p, _prepare(_spec(tmp_path / "clean", ["d.csv"], **extra), tmp_path, "prep-clean"))


def test_invalid_utf8_is_a_rejected_row_or_an_error_naming_file_and_line(tmp_path):
    lines = [b"1,a,1", b"0,caf\xe9,2", "1,cé,3".encode(), b"0,b", b"1,d,x", b"0,a,4"]  # 2-7
    path = _write(tmp_path / "d.csv", HEADER.encode() + b"".join(ln + b"\n" for ln in lines))
    p = _prepare(_spec(tmp_path, ["d.csv"], strict=False), tmp_path)
    assert p.stats["rejected"] == {"invalid UTF-8": 1, "wrong column count": 1, "not a number": 1}
    got = {(f, line, reason, col) for f, line, reason, col, _ in _rejects(p)}
    assert got == {
        (str(path), "line 3", "invalid UTF-8", "u"),
        (str(path), "line 5", "wrong column count", ""),
        (str(path), "line 6", "not a number", "x"),
    }
    assert [r[4] for r in _rejects(p) if r[2] == "invalid UTF-8"] == ["0\tcaf\\xe9\t2"]
    _clean_equal(p, tmp_path, HEADER + "1,a,1\n1,cé,3\n0,a,4\n")  # valid UTF-8 kept as is
    assert p.vocab.values["u"].to_pylist() == ["a", "cé"]

    with pytest.raises(TabularFormatError) as e:
        _prepare(_spec(tmp_path, ["d.csv"]), tmp_path, "prep-strict")
    assert str(e.value) == f"{path}: line 3: column 'u': invalid UTF-8: 'caf\\\\xe9'"

    # A bad byte in a column the spec does not read is never decoded.
    _write(tmp_path / "o.csv", b"label,u,x,note\n1,a,1,\xff\xfe\n0,b,2,ok\n")
    assert _prepare(_spec(tmp_path, ["o.csv"]), tmp_path, "prep-o").stats["rows"]["train"] == 2


QUOTED = (  # a line break inside a quoted value of a column no feature reads
    "label,u,x,note\n"
    "1,a,1,plain\n"  # line 2
    '0,b,2,"two\n'  # line 3
    'lines"\n'  # line 4
    "1,c,3,\n"  # line 5
    "0,b\n"  # line 6: malformed
    "1,d,x,\n"  # line 7: not a number
    '0,a,4,"cr\rinside"\n'  # line 8
    "1,e,5,last\n"  # line 9
)


def test_a_line_break_in_a_quoted_value_is_rejected_with_the_files_line_numbers(tmp_path):
    path = _write(tmp_path / "d.csv", QUOTED)
    p = _prepare(_spec(tmp_path, ["d.csv"], strict=False), tmp_path)
    brk = "line break in a quoted value"
    assert p.stats["rejected"] == {brk: 2, "wrong column count": 1, "not a number": 1}
    got = {(line, reason, col) for _, line, reason, col, _ in _rejects(p)}
    assert got == {
        ("line 3", brk, "note"),
        ("line 6", "wrong column count", ""),
        ("line 7", "not a number", "x"),
        ("line 8", brk, "note"),
    }
    assert all("\n" not in r[4] and "\r" not in r[4] for r in _rejects(p))
    _clean_equal(p, tmp_path, "label,u,x,note\n1,a,1,plain\n1,c,3,\n1,e,5,last\n")

    with pytest.raises(TabularFormatError) as e:
        _prepare(_spec(tmp_path, ["d.csv"]), tmp_path, "prep-strict")
    assert str(e.value).startswith(
        f"{path}: line 3: column 'note': line break in a quoted value (one row per line: convert "
        "the file to Parquet): 'two\\\\nlines'"
    )


def test_strict_names_the_first_bad_row_in_the_files_order(tmp_path):
    """A malformed row pyarrow skips and a bad row found after it are raised in file order."""
    _write(tmp_path / "a.csv", HEADER + '1,a,1\n0,b\n1,"c\nd",3\n')
    with pytest.raises(TabularFormatError, match=r"a\.csv: line 3: wrong column count"):
        _prepare(_spec(tmp_path, ["a.csv"]), tmp_path, "prep-a")
    _write(tmp_path / "b.csv", HEADER + '1,a,1\n1,"c\nd",3\n0,b\n')
    with pytest.raises(TabularFormatError, match=r"b\.csv: line 3: column 'u': line break"):
        _prepare(_spec(tmp_path, ["b.csv"]), tmp_path, "prep-b")


def test_a_header_over_64_kib_is_read_whole_and_one_over_the_bound_is_an_error(tmp_path):
    wide = [f"unused_column_{i:05d}" for i in range(5000)]  # 100 KB of names before ours
    header = ",".join([*wide, "label", "u", "x"]) + "\n"
    row = lambda *v: ",".join([*("0" * len(wide)), *v]) + "\n"  # noqa: E731
    _write(tmp_path / "w.csv", header + row("1", "a", "1") + row("0", "b", "2"))
    assert len(header) > 100_000
    p = _prepare(_spec(tmp_path, ["w.csv"]), tmp_path)
    assert p.stats["rows"]["train"] == 2
    np.testing.assert_array_equal(_train(p).ids_bfh[:, 0, 0], [1, 2])

    huge = _write(tmp_path / "h.csv", ",".join(f"c{i:07d}" for i in range(600_000)) + "\n1\n")
    with pytest.raises(TabularFormatError, match=re.escape(f"{huge}: line 1: the header line is")):
        _prepare(_spec(tmp_path, ["h.csv"]), tmp_path)
    bad = _write(tmp_path / "b.csv", b"label,\xffu,x\n1,a,1\n")
    with pytest.raises(TabularFormatError, match=re.escape(f"{bad}: line 1: the header is not")):
        _prepare(_spec(tmp_path, ["b.csv"]), tmp_path)


# ----------------------------------------------------------------------------- manifest


def test_a_crafted_manifest_is_a_one_line_error_never_a_read_outside_the_folder(tmp_path):
    _write(tmp_path / "d.csv", HEADER + GOOD)
    spec = _spec(tmp_path, ["d.csv"])
    manifest = Path(_prepare(spec, tmp_path).folder) / "manifest.json"
    good = json.loads(manifest.read_text())
    outside = _write(tmp_path / "outside.array_record", b"")
    shard = [os.path.relpath(outside, manifest.parent), 1]
    crafted = {
        "outside": {**good, "shards": {**good["shards"], "train": [shard]}},
        "absolute": {**good, "shards": {**good["shards"], "train": [[str(outside), 1]]}},
        "no_shards": {k: v for k, v in good.items() if k != "shards"},
        "rows_not_a_number": {**good, "shards": {"train": [[good["shards"]["train"][0][0], "x"]]}},
    }
    for case, m in crafted.items():
        manifest.write_text(json.dumps(m))
        with pytest.raises(TabularFormatError) as e:
            _prepare(spec, tmp_path)
        msg = str(e.value)
        assert msg.startswith(f"{manifest}: not a prepared dataset") and "\n" not in msg, case
    manifest.write_text("{not json")
    with pytest.raises(TabularFormatError, match=r"manifest\.json: not a prepared dataset"):
        _prepare(spec, tmp_path)
    manifest.write_text(json.dumps(good))
    assert _prepare(spec, tmp_path).stats["rows"]["train"] == 4


def test_a_planted_symbolic_link_never_redirects_a_write(tmp_path):
    _write(tmp_path / "d.csv", HEADER + GOOD)
    spec = _spec(tmp_path, ["d.csv"])
    folder = Path(prepared_folder(spec, str(tmp_path / "prep"))[0])
    victims = [_write(tmp_path / f"victim{i}", f"precious {i}\n") for i in range(3)]
    # Where this process writes a part's marker and its counts next, and an unfinished shard.
    part = "f00000-c0000-p000000"
    tmp = f".tmp{os.getpid()}"
    for victim, at in zip(
        victims,
        [f"parts/{part}.json{tmp}", f"count/{part}.arrow{tmp}", "shards/train/x.tmp"],
        strict=True,
    ):
        (folder / at).parent.mkdir(parents=True, exist_ok=True)
        (folder / at).symlink_to(victim)
    p = _prepare(spec, tmp_path)
    assert [v.read_bytes() for v in victims] == [f"precious {i}\n".encode() for i in range(3)]
    assert p.stats["rows"]["train"] == 4
    assert not [f for f in folder.rglob("*") if f.is_symlink()]

    other = _spec(tmp_path, ["d.csv"], name="other")
    lock = Path(prepared_folder(other, str(tmp_path / "prep"))[0]) / ".lock"
    lock.parent.mkdir(parents=True)
    lock.symlink_to(victims[0])
    with pytest.raises(TabularFormatError, match=re.escape(f"{lock}: cannot open the lock file")):
        _prepare(other, tmp_path)
    assert victims[0].read_text() == "precious 0\n"


def test_a_quoted_line_break_across_a_piece_cut_is_rejected_by_its_lines(tmp_path):
    head = "label,u,x,note\n" + "".join(f"1,a{i},1,plain\n" for i in range(50))  # lines 1-51
    text = head + '0,b,2,"two\nlines"\n' + "".join(f"1,c{i},3,\n" for i in range(50))
    _write(tmp_path / "d.csv", text)
    cut = {"piece_bytes": text.index("lines") - 3}  # the pieces meet inside the quoted value
    p = _prepare(_spec(tmp_path, ["d.csv"], strict=False, **cut), tmp_path)
    assert len(p.shards["train"]) == 2 and p.stats["rows"]["train"] == 100
    got = {(line, reason) for _, line, reason, _, _ in _rejects(p)}
    assert got == {("line 52", "line break in a quoted value"), ("line 53", "wrong column count")}
    with pytest.raises(TabularFormatError, match=r"d\.csv: line 52: column 'note': line break"):
        _prepare(_spec(tmp_path, ["d.csv"], **cut), tmp_path, "prep-strict")


def test_counting_resumes_from_its_arrow_files_to_the_same_vocabulary(tmp_path):
    rows = "".join(f"{i % 2},{'abcdefg'[i % 7]}{i % 5},{i * 0.5}\n" for i in range(40))
    _write(tmp_path / "d.csv", HEADER + rows)
    spec = _spec(tmp_path, ["d.csv"], rows_per_shard=6)
    clean = _prepare(spec, tmp_path, "clean")
    folder = Path(_prepare(spec, tmp_path).folder)
    counts = sorted((folder / "count").iterdir())
    assert len(counts) == 7 and all(f.suffix == ".arrow" for f in counts)
    # As if killed while counting: no vocabulary, no encoded part, one count file missing.
    for sub in ("vocab", "parts", "shards"):
        for f in (folder / sub).rglob("*"):
            if f.is_file():
                f.unlink()
    (folder / "manifest.json").unlink()
    counts[3].unlink()
    kept = {f: f.stat().st_mtime_ns for f in counts if f.exists()}
    resumed = _prepare(spec, tmp_path)
    assert all(f.stat().st_mtime_ns == t for f, t in kept.items())  # not counted again
    assert counts[3].exists()
    _same(clean, resumed)


def test_invalid_utf8_in_a_parquet_string_column_is_a_bad_row(tmp_path):
    """Parquet's reader does not check UTF-8: a bad value is rejected (lenient) or named by row
    group and row (strict), and the rows after it keep their own locations."""
    import pyarrow.parquet as pq

    u = pa.array([b"a", b"b", b"caf\xe9", b"c", b"d", b"e"], pa.binary()).view(pa.string())
    labels = [1, 0, 1, 0, 1, 2]  # the last, row group 1 row 2, is a bad label
    table = pa.table({"label": labels, "u": u, "x": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=3)
    path = tmp_path / "d.parquet"
    p = _prepare(_spec(tmp_path, ["d.parquet"], strict=False), tmp_path)
    assert p.stats["rejected"] == {"invalid UTF-8": 1, "label outside {0, 1}": 1}
    got = {(line, reason, col) for _, line, reason, col, _ in _rejects(p)}
    assert got == {
        ("row group 0, row 2", "invalid UTF-8", "u"),
        ("row group 1, row 2", "label outside {0, 1}", "label"),
    }
    np.testing.assert_array_equal(_train(p).ids_bfh[:, 0, 0], [1, 2, 3, 4])  # a, b, c, d
    with pytest.raises(TabularFormatError) as e:
        _prepare(_spec(tmp_path, ["d.parquet"]), tmp_path, "prep-strict")
    assert str(e.value) == f"{path}: row group 0, row 2: column 'u': invalid UTF-8: 'caf\\\\xe9'"
