"""Event logs through a sequence spec (``data/tabular/seq_spec.py``, ``seq_prepare.py``): spec
errors name the file and the field; bad events name file, line and column (strict) or are
counted (lenient); histories are ordered by time with ties and late rows counted; the prepared
histories and their splits equal ``data.sequences``' on the same events; ``inspect`` proposes
a sequence spec for an event log and not for a CTR table; sasrec/tiny trains on one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.csv as pacsv
import pytest
import yaml

from data.sequences import histories_from_arrow, leave_one_out, time_cutoff
from data.tabular import SpecError, TabularFormatError, example, inspect, load_spec
from data.tabular.seq_prepare import prepare_sequences, split_histories
from data.tabular.seq_spec import load_sequence_spec, sequence_spec_from_dict

HEADER = "user,item,ts,action\n"


def _spec(tmp_path: Path, text: str, **seq) -> Path:
    """A sequence spec of ``events.csv`` in ``tmp_path`` (``seq`` overrides the section)."""
    (tmp_path / "events.csv").write_text(text)
    section = {"user": "user", "item": "item", "time": "ts", "max_len": 10, **seq}
    spec = {"name": "ev", "train": ["events.csv"], "sequence": section}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _prepare(path: Path, **kw):
    spec = load_sequence_spec(path)
    if kw:
        spec = sequence_spec_from_dict(
            {**spec.to_dict(), **kw}, where=str(path), base_dir=spec.base_dir
        )
    return prepare_sequences(spec, str(path.parent / "prep"))


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize(
    "section, split, message",
    [
        (
            {"user": "u", "item": "i", "max_lenn": 5},
            None,
            r"spec.yaml: sequence: unknown field 'max_lenn'",
        ),
        ({"user": "u", "item": "i", "max_len": 2}, None, r"sequence: max_len must be >= 3"),
        (
            {"user": "u", "item": "i", "side": [{"name": "h", "kind": "numeric"}]},
            None,
            r"sequence.side\[0\]: side column 'h': numeric side columns need boundaries",
        ),
        (
            {"user": "u", "item": "i", "time_parse": "epoch"},
            None,
            r"sequence.time_parse: 'epoch' is not one of",
        ),
        (
            {"user": "u", "item": "i"},
            {"kind": "time", "valid_from": 5},
            r"split kind time needs sequence.time",
        ),
        (
            {"user": "u", "item": "i", "time": "t", "time_parse": "datetime"},
            {"kind": "time", "valid_from": 5},
            r"split.valid_from: 5.0 must be a datetime string",
        ),
        (
            {"user": "u", "item": "i", "time": "t", "time_parse": "datetime"},
            {"kind": "time", "valid_from": "2024-13-45"},
            r"split.valid_from: '2024-13-45' is not an ISO 8601 datetime",
        ),
        (
            {"user": "u", "item": "i", "time": "t"},
            {"kind": "time", "valid_from": 5, "test_from": 4},
            r"test_from must be >= valid_from",
        ),
        ({"user": "u", "item": "i"}, {"kind": "leave_one_out", "valid_from": 3}, r"kind time"),
        (
            {"user": "u", "item": "i", "side": [{"name": "time", "kind": "categorical"}]},
            None,
            r"side column 'time': the name 'time' is reserved",
        ),
    ],
)
def test_spec_errors_name_the_file_and_the_field(tmp_path, section, split, message):
    spec = {"train": "e.csv", "sequence": section, **({"split": split} if split else {})}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=message) as e:
        load_sequence_spec(path)
    assert str(e.value).startswith(f"{path}: ")


def test_each_loader_names_the_other_kind_of_spec(tmp_path):
    seq = tmp_path / "seq.yaml"
    seq.write_text(yaml.safe_dump({"train": "e.csv", "sequence": {"user": "u", "item": "i"}}))
    with pytest.raises(SpecError, match=r"seq.yaml: a sequence spec .*--data.kind tabular"):
        load_spec(seq)
    ctr = tmp_path / "ctr.yaml"
    ctr.write_text(example.SPEC)
    with pytest.raises(SpecError, match=r"ctr.yaml: no sequence section: a CTR spec"):
        load_sequence_spec(ctr)


# ----------------------------------------------------------------------------- bad events

BAD = HEADER + "a,1,10,view\na,x,11,view\nb,2,,view\n,3,12,buy\nb,3,1e3,buy\nc,5,14,buy\n"


def test_a_bad_event_names_file_line_and_column(tmp_path):
    path = _spec(tmp_path, BAD, item_parse="int")
    with pytest.raises(TabularFormatError) as e:
        _prepare(path)
    assert (
        str(e.value)
        == f"{tmp_path / 'events.csv'}: line 3: column 'item': item not an integer: 'x'"
    )
    (tmp_path / "events.csv").write_text(HEADER + "a,1,10,view\nb,2,,view\n")
    with pytest.raises(TabularFormatError, match=r"events.csv: line 3: column 'ts': missing time"):
        _prepare(path)
    path = _spec(tmp_path, HEADER + "a,1,2024-01-02,v\na,2,2024-01-0x,v\n", time_parse="datetime")
    with pytest.raises(
        TabularFormatError,
        match=r"line 3: column 'ts': time not an ISO 8601 datetime: '2024-01-0x'",
    ):
        _prepare(path)


def test_lenient_rejects_every_bad_event_and_counts_it_by_reason(tmp_path):
    p = _prepare(_spec(tmp_path, BAD + "c,6,15\n", item_parse="int"), strict=False)
    s = p.stats
    assert s["rejected"] == {
        "item not an integer": 1,
        "missing time": 1,
        "missing user": 1,
        "time not an integer": 1,
        "wrong column count": 1,
    }
    assert s["events_read"] == 7 and s["events_kept"] == 2
    assert sum(s["rejected"].values()) + s["events_kept"] == s["events_read"]
    assert any("line 4: column 'ts': missing time" in x for x in s["reject_examples"])
    assert p.hist.user_raw.tolist() == ["a", "c"]


# ----------------------------------------------------------------------------- ordering


def test_histories_are_ordered_by_time_with_ties_late_rows_and_truncation_counted(tmp_path):
    rows = "u2,b,5,view\nu1,c,3,view\nu1,a,1,cart\nu1,b,3,buy\nu2,a,2,\nu1,d,4,view\n"
    side = [
        {"name": "action", "kind": "categorical"},
        {"name": "band", "column": "ts", "kind": "numeric", "boundaries": [3]},
    ]
    p = _prepare(_spec(tmp_path, HEADER + rows, max_len=3, side=side))
    h, s = p.hist, p.stats
    # items a..d are ids 1..4; u1 by time: a(1) c(3) b(3, after c: the file's order) d(4).
    assert h.item_raw.tolist() == ["a", "b", "c", "d"]
    assert h.user_raw.tolist() == ["u1", "u2"]
    assert h.items.tolist() == [3, 2, 4, 1, 2]  # u1's oldest (a) cut by max_len 3
    assert h.offsets.tolist() == [0, 3, 5]
    assert h.times.tolist() == [3, 3, 4, 2, 5]
    # actions buy, cart, view are ids 1..3; 0 is a missing value (counted)
    assert h.side["action"].tolist() == [3, 1, 3, 0, 3]
    assert p.side_vocabs["action"].to_pylist() == ["buy", "cart", "view"]
    assert h.side["band"].tolist() == [2, 2, 2, 1, 2]  # 1 + (time >= 3)
    assert (s["ties"], s["out_of_order"], s["truncated_events"]) == (1, 2, 1)
    assert s["side_missing"] == {"action": 1, "band": 0} and s["items"] == 4
    # The vocabulary is saved beside the histories, and a second prepare loads the folder.
    again = _prepare(tmp_path / "spec.yaml")
    assert again.folder == p.folder and again.hist.items.tolist() == h.items.tolist()
    assert json.loads((Path(p.folder) / "manifest.json").read_text())["n_items"] == 4


def test_datetimes_order_events_in_utc(tmp_path):
    rows = (
        "a,i1,2024-01-02T01:00:00+02:00,v\n"  # 2024-01-01 23:00 UTC
        "a,i2,2024-01-01 22:00:00,v\n"
        "a,i3,2024-01-02,v\n"
        "a,i4,2024-01-01T23:30:00Z,v\n"
    )
    p = _prepare(_spec(tmp_path, HEADER + rows, time_parse="datetime"))
    assert p.hist.item_raw[p.hist.items - 1].tolist() == ["i2", "i1", "i4", "i3"]
    assert int(p.hist.times[-1]) == 1704153600 * 10**6  # 2024-01-02 00:00 UTC, microseconds
    # Lenient: a value that is no datetime is found among good ones and counted.
    bad = rows + "b,i5,2024-02-30,v\nb,i6,2024-03-01,v\n"
    p = _prepare(_spec(tmp_path, HEADER + bad, time_parse="datetime"), strict=False)
    assert p.stats["rejected"] == {"time not an ISO 8601 datetime": 1}
    assert p.stats["reject_examples"] == [
        f"{tmp_path / 'events.csv'}: line 6: column 'ts': time not an ISO 8601 datetime: "
        "'2024-02-30'"
    ]


def test_without_a_time_column_the_files_order_is_the_order(tmp_path):
    p = _prepare(_spec(tmp_path, HEADER + "a,z,9,v\nb,y,1,v\na,x,1,v\n", time=""))
    assert p.hist.items.tolist() == [3, 1, 2] and p.hist.times is None  # a: z then x
    assert (p.stats["ties"], p.stats["out_of_order"]) == (0, 0)


# ----------------------------------------------------------------------------- splits


@pytest.fixture(scope="module")
def shop_events(tmp_path_factory):
    d = tmp_path_factory.mktemp("events")
    example.make_events(str(d))
    (d / "spec.yaml").write_text(example.SEQUENCE_SPEC)
    return d


def _same(a, b):
    for field in ("items", "offsets", "user_raw", "item_raw", "times"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_prepared_histories_and_splits_equal_data_sequences(shop_events):
    spec = load_sequence_spec(shop_events / "spec.yaml")
    p = prepare_sequences(spec, str(shop_events / "prep"))
    events = pacsv.read_csv(shop_events / "events.csv")
    ref = histories_from_arrow(events, user="user_id", item="item_id", time="timestamp", max_len=50)
    _same(p.hist, ref)
    assert p.stats["ties"] == ref.counters.ties > 0
    assert p.stats["truncated_events"] == ref.counters.truncated_events > 0
    assert p.stats["out_of_order"] > 0  # the example writes 2% of its rows late

    loo, want = split_histories(spec, p.hist), leave_one_out(ref)
    rows = want.eval_rows()
    _same(loo.train, want.train)
    _same(loo.held_out["valid"][0], want.train.select(rows))
    _same(loo.held_out["test"][0], want.test_context.select(rows))
    np.testing.assert_array_equal(loo.held_out["valid"][1], want.valid_targets[rows])
    np.testing.assert_array_equal(loo.held_out["test"][1], want.test_targets[rows])

    valid_from, test_from = (int(np.percentile(ref.times, q)) for q in (70, 85))
    timed = sequence_spec_from_dict(
        {
            **spec.to_dict(),
            "split": {"kind": "time", "valid_from": valid_from, "test_from": test_from},
        },
        base_dir=spec.base_dir,
    )
    cut = split_histories(timed, p.hist)
    v, t = time_cutoff(ref, valid_from), time_cutoff(ref, test_from)
    _same(cut.train, v.train)
    _same(cut.held_out["valid"][0], v.test_context)
    _same(cut.held_out["test"][0], t.test_context)
    np.testing.assert_array_equal(cut.held_out["valid"][1], v.test_targets)
    np.testing.assert_array_equal(cut.held_out["test"][1], t.test_targets)
    assert cut.stats["valid_users_without_target"] == v.users_without_target > 0


# ----------------------------------------------------------------------------- inspect


def test_inspect_proposes_a_sequence_spec_for_an_event_log(shop_events, capsys):
    out = shop_events / "proposed.yaml"
    assert inspect.main([str(shop_events / "events.csv"), "--out", str(out)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    spec = yaml.safe_load(out.read_text())
    lengths = np.unique(
        pacsv.read_csv(shop_events / "events.csv").column("user_id").to_numpy(),
        return_counts=True,
    )[1]
    want = int(np.ceil(np.percentile(lengths, 95)))
    assert spec["sequence"] == {
        "user": "user_id",
        "item": "item_id",
        "item_parse": "int",
        "time": "timestamp",
        "time_parse": "int",
        "max_len": want,
        "side": [{"name": "action", "kind": "categorical"}],
    }
    assert spec["split"] == {"kind": "leave_one_out"} and "label" not in spec
    assert f"max_len {want}: the 95th percentile of the sample's history lengths" in err
    assert "--model.n-items 300" in err
    assert prepare_sequences(load_sequence_spec(out), str(shop_events / "p2")).hist.n_items == 300


def test_inspect_proposes_a_ctr_spec_for_a_ctr_table(tmp_path, capsys):
    example.make(str(tmp_path), rows=500)
    # A rated log with user, item and time: a CTR spec, and a note that it is an event log too.
    assert inspect.main([str(tmp_path / "interactions.csv")]) == 0
    cap = capsys.readouterr()
    assert "label" in yaml.safe_load(cap.out) and "sequence" not in yaml.safe_load(cap.out)
    assert "--kind sequence proposes a sequence spec" in " ".join(cap.err.split())
    # A plain CTR table (no time column): no sequence spec, and --kind sequence says why.
    plain = tmp_path / "plain.csv"
    plain.write_text("label,user_id,item_id,price\n1,u1,3,2.5\n0,u1,4,1.0\n1,u2,3,7.0\n")
    assert inspect.main([str(plain)]) == 0
    cap = capsys.readouterr()
    assert "sequence" not in yaml.safe_load(cap.out) and "event log" not in cap.err
    assert inspect.main([str(plain), "--kind", "sequence"]) == 2
    assert "not an event log for a sequence spec: no time-like column" in capsys.readouterr().err


def test_inspect_finds_a_datetime_column(tmp_path, capsys):
    log = tmp_path / "log.csv"
    rows = [f"c{k % 3},p{k % 5},2024-01-{1 + k:02d} 10:00:00" for k in range(12)]
    log.write_text("customer_id,product_id,event_time\n" + "\n".join(rows) + "\n")
    assert inspect.main([str(log)]) == 0
    seq = yaml.safe_load(capsys.readouterr().out)["sequence"]
    assert (seq["user"], seq["item"], seq["time"]) == ("customer_id", "product_id", "event_time")
    assert seq["time_parse"] == "datetime" and "item_parse" not in seq
