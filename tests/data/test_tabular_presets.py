"""Frappe and Criteo re-expressed as feature specs give their dedicated readers' batches, and a
killed preparation resumes to the same shards."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data.builders import make_source
from data.config import CRITEO_KAGGLE_VOCAB_SIZES, CriteoConfig, DataConfig, TabularConfig
from data.presets import frappe as frappe_preset
from data.tabular import prepare
from data.tabular.presets import criteo_spec, frappe_spec, write_spec
from data.tabular.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


def _assert_same_source(a, b, steps) -> None:
    assert a.schema == b.schema
    for step in steps:
        for name, x, y in zip(
            a.train_batch(0)._fields, a.train_batch(step), b.train_batch(step), strict=True
        ):
            np.testing.assert_array_equal(x, y, err_msg=f"train step {step} field {name}")
    ea, eb = list(a.eval_batches()), list(b.eval_batches())
    assert len(ea) == len(eb)
    for j, (x, y) in enumerate(zip(ea, eb, strict=True)):
        for name, u, v in zip(x._fields, x, y, strict=True):
            np.testing.assert_array_equal(u, v, err_msg=f"eval batch {j} field {name}")


def test_frappe_spec_gives_the_readers_batches(frappe_files, tmp_path):
    spec_path = tmp_path / "frappe.yaml"
    write_spec(frappe_spec(str(frappe_files.path)), str(spec_path))
    base = dataclasses.replace(
        frappe_preset(str(frappe_files.path)), batch_size=512, eval_batch_size=1024
    )
    reader = make_source(base)
    tab = make_source(
        dataclasses.replace(
            base,
            kind="tabular",
            tabular=TabularConfig(spec=str(spec_path), prepared_dir=str(tmp_path / "prep")),
        )
    )
    _assert_same_source(reader, tab, steps=[0, 1, 7, 100])
    # Values unseen in training map to id 0 in both and are counted alike.
    reader_oov = {k: v for k, v in reader.stats["eval"]["oov"].items() if v}
    tab_oov = {k: v["valid"] for k, v in tab.stats["oov"].items() if v["valid"]}
    assert reader_oov == tab_oov


def test_criteo_spec_gives_the_readers_batches(criteo_files, tmp_path):
    path = str(criteo_files.path)
    spec_path = tmp_path / "criteo.yaml"
    write_spec(criteo_spec((path,), valid=(path,)), str(spec_path))
    base = DataConfig(
        kind="criteo",
        train_path=path,
        eval_path=path,
        batch_size=256,
        eval_batch_size=512,
        criteo=CriteoConfig(vocab_sizes=CRITEO_KAGGLE_VOCAB_SIZES),
    )
    reader = make_source(base)
    tab = make_source(
        dataclasses.replace(
            base,
            kind="tabular",
            tabular=TabularConfig(spec=str(spec_path), prepared_dir=str(tmp_path / "prep")),
        )
    )
    _assert_same_source(reader, tab, steps=[0, 3, 8])


def test_criteo_spec_lenient_rejects_what_the_reader_rejects(generated_criteo, tmp_path):
    from data.criteo.reader import read_criteo

    lines = generated_criteo.read_text().splitlines()[:300]
    cols = {i: lines[i].split("\t") for i in (10, 20, 30, 40)}
    bad = {
        10: "\t".join([cols[10][0], "abc", *cols[10][2:]]),  # I1 not an integer
        20: "\t".join(cols[20][:-1]),  # 39 columns
        30: "\t".join([*cols[30][:20], "xyz", *cols[30][21:]]),  # C7 not hex
        40: "\t".join(["2", *cols[40][1:]]),  # label 2
    }
    for i, text in bad.items():
        lines[i] = text
    path, good = tmp_path / "bad.tsv", tmp_path / "good.tsv"
    path.write_text("".join(line + "\n" for line in lines))
    good.write_text("".join(line + "\n" for line in lines[:5]))
    rows, stats = read_criteo(
        str(path), CriteoConfig(strict=False), rejects_path=str(tmp_path / "r.tsv")
    )
    spec = dataclasses.replace(criteo_spec((str(path),), valid=(str(good),)), strict=False)
    p = prepare(spec, str(tmp_path / "prep"), progress=False)
    assert stats.rows_rejected == sum(p.stats["rejected"].values()) == len(bad)
    assert p.stats["rows"]["train"] == stats.rows_kept
    rejected_lines = []
    for f in sorted((Path(p.folder) / "rejects").glob("*.tsv")):
        rejected_lines += [r.split("\t")[1] for r in f.read_text().splitlines()[1:]]
    assert sorted(rejected_lines) == sorted(f"line {i + 1}" for i in bad)
    recs = p.records("train")  # the kept rows, encoded as the reader encodes them
    got = p.to_batch(recs.__getitems__(list(range(len(recs)))))
    for name, u, v in zip(got._fields, got, rows, strict=True):
        np.testing.assert_array_equal(u, v, err_msg=name)


def _toy_csv(path: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 500, n)
    items = rng.integers(0, 2000, n)
    x = rng.normal(size=n).round(4)
    y = (rng.random(n) < 0.3).astype(int)
    text = "".join(f"{a},{b},{c},{d}\n" for a, b, c, d in zip(y, users, items, x, strict=True))
    path.write_text("label,user,item,x\n" + text)


def _spec_file(tmp_path: Path, rows_per_shard: int, piece_bytes: int = 256 << 20) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: toy\ntrain: [data.csv]\nlabel: {column: label}\n"
        f"rows_per_shard: {rows_per_shard}\npiece_bytes: {piece_bytes}\n"
        "features:\n  - {name: user, kind: categorical, parse: int}\n"
        "  - {name: item, kind: categorical}\n  - {name: x, kind: numeric, standardize: true}\n"
    )
    return spec


def _workers_of(folder: Path) -> list[int]:
    """Pids of live preparation workers writing into ``folder``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--worker" in cmd and str(folder).encode() in cmd:
                out.append(int(d.name))
    return out


def _all_records(p) -> dict[str, list[bytes]]:
    out = {}
    for split in ("train", "valid"):
        src = p.records(split)
        out[split] = src.__getitems__(list(range(len(src))))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_killed_preparation_resumes_to_the_same_shards(tmp_path, workers):
    """SIGKILL mid-way (in-process, or the parent of two worker processes, which die with it):
    the relaunch keeps the finished parts and ends with the uninterrupted run's shards."""
    _toy_csv(tmp_path / "data.csv", 300_000)
    spec = _spec_file(tmp_path, rows_per_shard=10_000, piece_bytes=2_000_000)
    clean = prepare(str(spec), str(tmp_path / "clean"), progress=False)

    root = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "data.tabular.prepare",
            str(spec),
            "--root",
            str(root),
            "--workers",
            str(workers),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    parts = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(root.glob("*/parts/*.json"))
        if len(found) >= 2:
            parts = {f: f.stat().st_mtime_ns for f in found}
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert parts is not None, "the preparation finished before it could be killed"
    folder = next(root.iterdir())
    deadline = time.monotonic() + 10  # orphaned workers would still write parts
    while _workers_of(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _workers_of(folder)
    assert not (folder / "manifest.json").exists()
    assert len(list((folder / "parts").glob("*.json"))) < 30  # killed mid-way through 30 parts

    resumed = prepare(str(spec), str(root), progress=False)
    for f, mtime in parts.items():  # parts finished before the kill were not redone
        assert f.stat().st_mtime_ns == mtime
    assert not list(folder.glob("shards/*/*.tmp*"))
    assert resumed.stats["rows"] == clean.stats["rows"]
    a, b = _all_records(clean), _all_records(resumed)
    assert a == b


def test_spec_round_trips_through_yaml_and_json(tmp_path):
    spec = criteo_spec(("day_*.gz",), vocab_sizes=CRITEO_KAGGLE_VOCAB_SIZES)
    for name in ("c.yaml", "c.json"):
        write_spec(spec, str(tmp_path / name))
        loaded = load_spec(tmp_path / name)
        assert dataclasses.replace(loaded, base_dir="") == spec


def _piece_spec(tmp_path: Path, *, piece_bytes: int, strict: bool = True, rows: int = 0) -> Path:
    spec = tmp_path / f"spec_{piece_bytes}_{strict}_{rows}.yaml"
    spec.write_text(
        "name: toy\ntrain: [data.csv]\nvalid: [valid.csv]\nsplit: {kind: files}\n"
        f"label: {{column: label}}\npiece_bytes: {piece_bytes}\nstrict: {str(strict).lower()}\n"
        + (f"rows_per_shard: {rows}\n" if rows else "")
        + "features:\n  - {name: user, kind: categorical, parse: int}\n"
        "  - {name: item, kind: categorical}\n  - {name: x, kind: numeric, standardize: true}\n"
    )
    return spec


def test_pieces_of_a_large_csv_give_the_whole_files_records(tmp_path):
    """A CSV cut at line ends into byte-range pieces (prepared in parallel) gives the records,
    vocabularies and scales of the uncut file, with one worker or two."""
    _toy_csv(tmp_path / "data.csv", 3000)
    _toy_csv(tmp_path / "valid.csv", 200, seed=1)
    whole = prepare(
        str(_piece_spec(tmp_path, piece_bytes=10**9)), str(tmp_path / "a"), progress=False
    )
    spec = _piece_spec(tmp_path, piece_bytes=8000)
    from data.tabular.passes import resolve_inputs, work_units

    units = work_units(load_spec(spec), resolve_inputs(load_spec(spec)))
    assert sum(u[0] == 0 for u in units) > 5  # the training file is cut into pieces
    one = prepare(str(spec), str(tmp_path / "b"), workers=1, progress=False)
    two = prepare(str(spec), str(tmp_path / "c"), workers=2, progress=False)
    for p in (one, two):
        assert _all_records(p) == _all_records(whole)
        assert p.vocab.scales == whole.vocab.scales
        assert p.vocab.values["item"].equals(whole.vocab.values["item"])


def test_bad_lines_in_later_pieces_are_named_by_their_file_line(tmp_path):
    _toy_csv(tmp_path / "data.csv", 3000)
    _toy_csv(tmp_path / "valid.csv", 50, seed=1)
    lines = (tmp_path / "data.csv").read_text().splitlines()
    bad_lines = {700: "1,2", 1501: "1,2,3,4,5", 2600: "0,5,7,abc"}  # 1-based file lines
    for n, text in bad_lines.items():
        lines[n - 1] = text
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(Exception, match=r"data.csv: line 700: wrong column count"):
        prepare(str(_piece_spec(tmp_path, piece_bytes=8000)), str(tmp_path / "s"), progress=False)
    lenient = _piece_spec(tmp_path, piece_bytes=8000, strict=False, rows=250)
    p = prepare(str(lenient), str(tmp_path / "l"), workers=2, progress=False)
    found = {}
    for f in sorted((Path(p.folder) / "rejects").glob("*.tsv")):
        for r in f.read_text().splitlines()[1:]:
            _, where, reason, *_ = r.split("\t")
            found[int(where.removeprefix("line "))] = reason
    assert found == {700: "wrong column count", 1501: "wrong column count", 2600: "not a number"}
    assert p.stats["rows"]["train"] == 3000 - 3


def test_two_processes_preparing_at_once_prepare_once(tmp_path):
    """Two launches at the same time (a multi-process run's hosts on one machine) take turns on
    the folder's lock: the second finds the first's result."""
    _toy_csv(tmp_path / "data.csv", 20_000)
    spec = _spec_file(tmp_path, rows_per_shard=2_000)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "data.tabular.prepare", str(spec), "--root", str(tmp_path / "r")]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    clean = prepare(str(spec), str(tmp_path / "clean"), progress=False)
    (folder,) = (tmp_path / "r").iterdir()
    from data.tabular.prepare import Prepared

    assert _all_records(Prepared.load(str(folder), load_spec(spec))) == _all_records(clean)


def test_lenient_rejects_of_a_piece_with_no_good_line_are_counted(tmp_path):
    """Tiny pieces, some of only malformed lines: every malformed line is written and counted,
    with one worker or two (nothing is dropped because a piece has no rows)."""
    good = [f"{i % 2},{i},{i % 7},0.5" for i in range(50)]
    lines = good[:10] + ["1,2"] * 4 + good[10:30] + ["1,2,3,4,5"] * 4 + good[30:]
    (tmp_path / "data.csv").write_text("label,user,item,x\n" + "\n".join(lines) + "\n")
    _toy_csv(tmp_path / "valid.csv", 20, seed=1)
    spec = _piece_spec(tmp_path, piece_bytes=60, strict=False, rows=5)
    for workers in (1, 2):
        p = prepare(str(spec), str(tmp_path / f"w{workers}"), workers=workers, progress=False)
        assert p.stats["rejected"] == {"wrong column count": 8}
        assert p.stats["rows"]["train"] == 50
        found = []
        for f in sorted((Path(p.folder) / "rejects").glob("*.tsv")):
            found += [
                int(r.split("\t")[1].removeprefix("line ")) for r in f.read_text().splitlines()[1:]
            ]
        assert sorted(found) == [12, 13, 14, 15, 36, 37, 38, 39]


def test_array_record_files_keep_few_readers_open(tmp_path, monkeypatch):
    from array_record.python.array_record_module import ArrayRecordWriter

    from data.record_files import ArrayRecordFiles

    files = []
    for i in range(12):
        files.append(str(tmp_path / f"{i}.array_record"))
        w = ArrayRecordWriter(files[-1], "group_size:16,uncompressed")
        for j in range(3):
            w.write(bytes([i, j]))
        w.close()
    monkeypatch.setattr(ArrayRecordFiles, "MAX_OPEN", 4)
    src = ArrayRecordFiles(files, [3] * 12, [0] * 12)
    keys = list(range(35, -1, -1))
    assert src.__getitems__(keys) == [bytes([k // 3, k % 3]) for k in keys]
    assert len(src._open) == 4 and sum(r is not None for r in src._readers) == 4
