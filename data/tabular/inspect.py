"""``python -m data.tabular.inspect FILE [SIDE_FILE ...] [--rows N] [--kind auto|ctr|sequence]
[--out spec.yaml]``

Reads a sample of each file (the first ``--rows`` rows), prints per column its inferred type,
missing rate, distinct values in the sample and top values, and proposes a spec to edit: a
feature spec for the CTR families (``--kind ctr``), or a sequence spec for the sequential ones
(``--kind sequence``); ``auto`` (the default) proposes a CTR spec when the first file has a
label, else a sequence spec when it is an event log. A CTR spec:

* the first file holds the interactions; each further file is a side table, joined on the column
  it shares with the interactions whose values are unique in the side file;
* the label: a column named like a label (``label``, ``click``, ``y``, ...) or the only 0/1
  column; a 1-5 ``rating`` becomes ``rating >= 4``;
* integer columns with a name like an id, and string columns, are categorical: hashed when the
  sample already shows more than ``--hash-above`` distinct values, else a vocabulary; a string
  column whose values mostly hold a ``|``, ``;`` or ``,`` list is multi-valued (``max_hotness``
  the sample's 99th percentile of list length); other numbers are numeric (``log`` for skewed
  non-negative values, else ``standardize``);
* a time-like column (``time``, ``timestamp``, ``date``, ``ts``) proposes a time split at the
  sample's 90th percentile; otherwise a seeded random 10% validation split.

A sequence spec (``data/tabular/seq_spec.py``), when the first file is an event log: a
user-like id column (``user``, ``uid``, ``customer``, ``visitor``, ``session``, ... with repeated
values), an item-like one (``item``, ``movie``, ``product``, ``sku``, ``song``, ...) and a
time-like one (an integer or decimal column named like a time, or one of datetimes: a
timestamp column, or strings that parse as ISO 8601). ``max_len`` is the 95th percentile of
the sample's history lengths (events per user); the other low-cardinality columns (at most 50
values) become categorical side columns; the split is leave-one-out.

The proposal is a starting point: it only sees the sample, so check cardinalities and the split.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from data.tabular.seq_spec import parse_datetimes

_LABEL_NAMES = ("label", "click", "clicked", "is_click", "y", "target", "clk", "conversion")
_TIME_NAMES = re.compile(r"(^|_)(time|timestamp|date|ts|datetime)($|_)", re.I)
_ID_NAMES = re.compile(r"(^|_)(id|uid|iid|user|item|movie|ad|product|category|cat)($|_|id)", re.I)
_SEPARATORS = ("|", ";", ",")
_ID_SUFFIX = r"(_?id)?($|_)"
_USER_NAMES = re.compile(
    r"(^|_)(user|uid|customer|visitor|member|session|account|client|reader|viewer|buyer|"
    r"player|listener)" + _ID_SUFFIX,
    re.I,
)
_ITEM_NAMES = re.compile(
    r"(^|_)(item|iid|movie|product|sku|article|song|track|video|book|asin|business|poi|ad|"
    r"content|post|artist|game|doc|recipe|course|offer|listing)" + _ID_SUFFIX,
    re.I,
)


def read_sample(path: str, rows: int) -> tuple[pa.Table, dict[str, Any]]:
    """The first ``rows`` rows and how the file was read (delimiter, header) for the spec."""
    if path.lower().endswith((".parquet", ".pq")):
        f = pq.ParquetFile(path)
        batches = []
        n = 0
        for b in f.iter_batches(batch_size=min(rows, 65536)):
            batches.append(b)
            n += b.num_rows
            if n > rows:
                break
        return pa.Table.from_batches(batches).slice(0, rows), {"whole": n <= rows}
    with pa.input_stream(path, compression="detect") as fh:
        head = fh.read(1 << 16).decode("utf-8", "replace")
    if not head.strip():
        raise ValueError(f"{path}: empty file")
    lines = head.splitlines()
    sniff = "\n".join(lines[: min(len(lines), 50)])
    try:
        dialect = csv.Sniffer().sniff(sniff, delimiters=",\t;|")
        delimiter = dialect.delimiter
    except csv.Error:
        delimiter = "\t" if ".tsv" in path.lower() else ","
    try:
        header = csv.Sniffer().has_header(sniff)
    except csv.Error:
        header = True
    read = pacsv.ReadOptions(autogenerate_column_names=not header, block_size=1 << 22)
    # Only an empty field is missing, as in a spec's default null_values (pyarrow's own list
    # would also take "NA" or "null", which the preparation would then reject as bad values).
    convert = pacsv.ConvertOptions(null_values=[""], strings_can_be_null=True)
    reader = pacsv.open_csv(
        path,
        read_options=read,
        convert_options=convert,
        parse_options=pacsv.ParseOptions(delimiter=delimiter, invalid_row_handler=lambda r: "skip"),
    )
    batches, n, whole = [], 0, True
    for b in reader:
        batches.append(b)
        n += b.num_rows
        if n > rows:
            whole = False
            break
    table = pa.Table.from_batches(batches, schema=reader.schema).slice(0, rows)
    how: dict[str, Any] = {"delimiter": delimiter, "header": header, "whole": whole}
    if not header:
        how["column_names"] = list(table.column_names)
    return table, how


def describe(table: pa.Table) -> list[dict[str, Any]]:
    """Per column: type, missing rate, distinct count, top values, list shape."""
    out = []
    n = max(table.num_rows, 1)
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        t = col.type
        if not (
            pa.types.is_integer(t)
            or pa.types.is_floating(t)
            or pa.types.is_boolean(t)
            or pa.types.is_string(t)
        ):  # dates, times, ...: described as their text
            col = pc.cast(col, pa.string())
            t = col.type
        kind = (
            "int"
            if pa.types.is_integer(t)
            else "float"
            if pa.types.is_floating(t)
            else "bool"
            if pa.types.is_boolean(t)
            else "string"
        )
        present = col.drop_null()
        if kind == "string":
            present = present.filter(pc.not_equal(present, ""))
        counts = pc.value_counts(present)
        top = sorted(
            zip(
                counts.field("counts").to_pylist(), counts.field("values").to_pylist(), strict=True
            ),
            reverse=True,
        )[:3]
        d: dict[str, Any] = {
            "name": name,
            "type": kind,
            "missing": 1 - len(present) / n,
            "distinct": len(counts),
            "top": [v for _, v in top],
        }
        if kind in ("int", "float") and len(present):
            x = present.to_numpy(zero_copy_only=False).astype(np.float64)
            d.update(min=float(x.min()), max=float(x.max()), median=float(np.median(x)))
        if kind == "string" and len(present):
            for sep in _SEPARATORS:
                has = pc.match_substring(present, sep)
                share = float(pc.mean(pc.cast(has, pa.float64())).as_py() or 0.0)
                if share >= 0.2:
                    lengths = pc.list_value_length(pc.split_pattern(present, sep)).to_numpy()
                    d.update(separator=sep, max_hotness=int(np.percentile(lengths, 99)))
                    break
        out.append(d)
    return out


def _label(cols: list[dict]) -> tuple[dict, dict] | None:
    by = {c["name"].lower(): c for c in cols}
    for name in _LABEL_NAMES:
        if name in by:
            return by[name], {"column": by[name]["name"]}
    binary = [
        c
        for c in cols
        if c["type"] in ("int", "float", "bool")
        and c["distinct"] == 2
        and c.get("min") == 0
        and c.get("max") == 1
    ]
    if len(binary) == 1:
        return binary[0], {"column": binary[0]["name"]}
    if "rating" in by and by["rating"]["type"] in ("int", "float"):
        return by["rating"], {"column": by["rating"]["name"], "threshold": 4}
    return None


def _feature(c: dict, hash_above: int) -> dict[str, Any]:
    name = c["name"]
    if c.get("separator"):
        return {
            "name": name,
            "kind": "multi_categorical",
            "separator": c["separator"],
            "max_hotness": max(1, c["max_hotness"]),
        }
    categorical = c["type"] == "string" or (
        c["type"] in ("int", "bool") and (_ID_NAMES.search(name) or c["distinct"] <= 50)
    )
    if categorical:
        f: dict[str, Any] = {"name": name, "kind": "categorical"}
        if c["type"] == "int":
            f["parse"] = "int"
        if c["distinct"] > hash_above:
            f["hash_buckets"] = int(2 ** np.ceil(np.log2(4 * c["distinct"])))
        return f
    f = {"name": name, "kind": "numeric"}
    if c.get("min", -1) >= 0 and c.get("max", 0) > 100 * max(c.get("median", 0), 1):
        f["log"] = True
    else:
        f["standardize"] = True
    return f


def propose(
    paths: list[str], rows: int = 100_000, hash_above: int = 100_000, kind: str = "auto"
) -> tuple[dict, list, list[str]]:
    """(spec dict, per-file column descriptions, notes for the user); ``kind`` is ``auto``,
    ``ctr`` or ``sequence`` (module docstring)."""
    tables, hows, descs = [], [], []
    for p in paths:
        t, how = read_sample(p, rows)
        tables.append(t)
        hows.append(how)
        descs.append(describe(t))
    main = descs[0]
    events, why_not = event_columns(tables[0], main)
    label = _label(main)
    if kind == "sequence" or (kind == "auto" and label is None and events is not None):
        if events is None:
            raise ValueError(f"{paths[0]}: not an event log for a sequence spec: {why_not}")
        return _sequence_spec(paths, tables[0], hows[0], main, events), descs, events["notes"]
    if label is None:
        extra = f"; nor an event log for a sequence spec: {why_not}" if kind == "auto" else ""
        raise ValueError(
            f"{paths[0]}: no label column found (name one label/click/y, or edit){extra}"
        )
    notes = []
    if events is not None:
        notes.append(
            f"{events['user']!r}, {events['item']!r} and {events['time']!r} also make an event "
            "log: --kind sequence proposes a sequence spec for the sequential families"
        )
    spec: dict[str, Any] = {
        "name": re.sub(r"\W+", "_", os.path.basename(paths[0]).split(".")[0]),
        "train": [os.path.abspath(paths[0])],
    }
    if "delimiter" in hows[0] and (hows[0]["delimiter"] != "," or not hows[0]["header"]):
        spec["format"] = _format(hows[0])
    joins, side_cols = [], []
    for p, t, how, desc in zip(paths[1:], tables[1:], hows[1:], descs[1:], strict=True):
        shared = [
            c["name"]
            for c in desc
            if c["name"] in tables[0].column_names and c["distinct"] == t.num_rows
        ]
        if not shared:
            raise ValueError(f"{p}: no column shared with {paths[0]} has unique values here")
        j: dict[str, Any] = {"path": [os.path.abspath(p)], "key": shared[0]}
        if "delimiter" in how and (how["delimiter"] != "," or not how["header"]):
            j["format"] = _format(how)
        joins.append(j)
        side_cols += [c for c in desc if c["name"] != shared[0]]
    if joins:
        spec["joins"] = joins
    time_col = next(
        (c for c in main if _TIME_NAMES.search(c["name"]) and c["type"] in ("int", "float")), None
    )
    if time_col is not None and not hows[0]["whole"]:
        notes.append(
            f"time column {time_col['name']!r} found, but the sample is not the whole file: "
            "a random split is proposed; for a split by time set split kind time, column and "
            "valid_from yourself (the sample's first rows need not span the file's times)"
        )
        time_col = None
    if time_col is not None:
        x = tables[0].column(time_col["name"]).drop_null().to_numpy().astype(np.float64)
        spec["split"] = {
            "kind": "time",
            "column": time_col["name"],
            "valid_from": float(np.percentile(x, 90)),
        }
    else:
        spec["split"] = {"kind": "random", "valid_fraction": 0.1, "seed": 0}
    spec["label"] = label[1]
    skip = {label[0]["name"], *(c["name"] for c in [time_col] if c)}
    features = [
        _feature(c, hash_above)
        for c in main + side_cols
        if c["name"] not in skip and c["distinct"] > 1
    ]
    spec["features"] = features
    return spec, descs, notes


def event_columns(table: pa.Table, desc: list[dict]) -> tuple[dict | None, str]:
    """The user, item and time columns of an event log (and how its times parse), or None and
    what is missing."""
    by = {c["name"]: c for c in desc}
    user = next(
        (
            c["name"]
            for c in desc
            if _USER_NAMES.search(c["name"]) and 1 < c["distinct"] < table.num_rows
        ),
        None,
    )
    item = next(
        (
            c["name"]
            for c in desc
            if _ITEM_NAMES.search(c["name"]) and c["name"] != user and c["distinct"] > 1
        ),
        None,
    )
    time, parse = None, ""
    for name in table.column_names:
        t = table.schema.field(name).type
        if pa.types.is_timestamp(t) or pa.types.is_date(t):
            time, parse = name, "datetime"
        elif _TIME_NAMES.search(name) and by[name]["type"] in ("int", "float"):
            time, parse = name, by[name]["type"]
        elif _TIME_NAMES.search(name) and by[name]["type"] == "string" and _datetimes(table, name):
            time, parse = name, "datetime"
        if time:
            break
    missing = [
        what
        for what, col in (
            ("no user-like id column with repeated values (user, uid, customer, ...)", user),
            ("no item-like id column (item, movie, product, ...)", item),
            ("no time-like column (a time-named number, or datetimes)", time),
        )
        if col is None
    ]
    if missing:
        return None, "; ".join(missing)
    return {"user": user, "item": item, "time": time, "time_parse": parse, "notes": []}, ""


def _datetimes(table: pa.Table, name: str) -> bool:
    """Whether at least 99% of a string column's present values parse as ISO 8601."""
    col = table.column(name).combine_chunks().drop_null()
    if not len(col):
        return False
    _, bad = parse_datetimes(col)
    return bad.mean() <= 0.01


def _sequence_spec(
    paths: list[str], table: pa.Table, how: dict, desc: list[dict], ev: dict
) -> dict[str, Any]:
    """A sequence spec of the event log ``table`` (columns ``ev``); says why in ``ev["notes"]``."""
    notes = ev["notes"]
    users = table.column(ev["user"]).combine_chunks().drop_null()
    counts = pc.value_counts(users).field("counts").to_numpy()
    p95 = int(np.ceil(np.percentile(counts, 95)))
    max_len = max(3, p95)
    by = {c["name"]: c for c in desc}
    item = by[ev["item"]]
    notes.append(
        f"an event log: user {ev['user']!r} ({len(counts):,} users in the sample), item "
        f"{ev['item']!r} ({item['distinct']:,} items), time {ev['time']!r} "
        f"({ev['time_parse']}); a sequence spec for the sequential families"
    )
    notes.append(
        f"max_len {max_len}: the 95th percentile of the sample's history lengths (median "
        f"{np.median(counts):g}, max {counts.max()}); longer histories keep their most recent "
        f"{max_len} events"
        + ("" if how["whole"] else " (the sample is the file's first rows: check on all of it)")
    )
    seq: dict[str, Any] = {"user": ev["user"], "item": ev["item"]}
    if item["type"] == "int":
        seq["item_parse"] = "int"
    seq.update(time=ev["time"], time_parse=ev["time_parse"], max_len=max_len)
    used = {ev["user"], ev["item"], ev["time"]}
    side = []
    for c in desc:
        if c["name"] in used or not (1 < c["distinct"] <= 50) or c["type"] == "float":
            continue
        side.append({"name": c["name"], "kind": "categorical"})
        if c["type"] == "int":
            side[-1]["parse"] = "int"
    if side:
        seq["side"] = side
        notes.append(
            "side columns (at most 50 values, carried beside the items): "
            + ", ".join(s["name"] for s in side)
        )
    if len(paths) > 1:
        notes.append("side tables are not joined into a sequence spec: " + ", ".join(paths[1:]))
    spec: dict[str, Any] = {
        "name": re.sub(r"\W+", "_", os.path.basename(paths[0]).split(".")[0]),
        "train": [os.path.abspath(paths[0])],
    }
    if "delimiter" in how and (how["delimiter"] != "," or not how["header"]):
        spec["format"] = _format(how)
    spec.update(sequence=seq, split={"kind": "leave_one_out"})
    notes.append("split leave_one_out: each user's last event test, the one before it validation")
    return spec


def _format(how: dict) -> dict:
    out: dict[str, Any] = {"delimiter": how["delimiter"]}
    if not how["header"]:
        out.update(header=False, column_names=how["column_names"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(  # the module docstring after its usage line, as written
        prog="python -m data.tabular.inspect",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("files", nargs="+", help="interactions file, then side tables")
    ap.add_argument("--rows", type=int, default=100_000, help="sample rows per file")
    ap.add_argument(
        "--hash-above",
        type=int,
        default=100_000,
        help="hash a categorical with more distinct values than this in the sample",
    )
    ap.add_argument(
        "--kind",
        choices=("auto", "ctr", "sequence"),
        default="auto",
        help="propose a CTR feature spec or a sequence spec (auto: CTR if a label is found)",
    )
    ap.add_argument("--out", default="", help="write the proposed spec here (else stdout)")
    args = ap.parse_args(argv)
    try:
        spec, descs, notes = propose(args.files, args.rows, args.hash_above, args.kind)
    except (ValueError, OSError, pa.ArrowInvalid) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import yaml
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    for path, desc in zip(args.files, descs, strict=True):
        t = Table(title=f"{path} (sample)")
        for h in ("column", "type", "missing", "distinct", "range / list", "top values"):
            t.add_column(h)
        for c in desc:
            rng = (
                f"{c['min']:g} .. {c['max']:g}"
                if "min" in c
                else f"list '{c['separator']}' p99 {c['max_hotness']}"
                if "separator" in c
                else ""
            )
            t.add_row(
                c["name"],
                c["type"],
                f"{c['missing']:.1%}",
                f"{c['distinct']:,}",
                rng,
                ", ".join(str(v)[:16] for v in c["top"]),
            )
        console.print(t)
    for note in notes:
        console.print(f"note: {note}")
    text = yaml.safe_dump(spec, sort_keys=False, width=100)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
        if "sequence" in spec:
            item = spec["sequence"]["item"]
            n = next(c["distinct"] for c in descs[0] if c["name"] == item)
            console.print(
                f"wrote {args.out}: edit it, then train with python -m sequential.sasrec.train "
                f"sasrec/tiny --data.kind tabular --data.tabular.spec {args.out} "
                f"--model.n-items {n} (the sample's items; the run names the log's count if "
                "it differs)"
            )
        else:
            console.print(
                f"wrote {args.out}: edit it, then train with --data.kind tabular "
                f"--data.tabular.spec {args.out}"
            )
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
