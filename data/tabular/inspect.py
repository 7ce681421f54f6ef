"""``python -m data.tabular.inspect FILE [SIDE_FILE ...] [--rows N] [--out spec.yaml]``

Reads a sample of each file (the first ``--rows`` rows), prints per column its inferred type,
missing rate, distinct values in the sample and top values, and proposes a feature spec to edit:

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

_LABEL_NAMES = ("label", "click", "clicked", "is_click", "y", "target", "clk", "conversion")
_TIME_NAMES = re.compile(r"(^|_)(time|timestamp|date|ts|datetime)($|_)", re.I)
_ID_NAMES = re.compile(r"(^|_)(id|uid|iid|user|item|movie|ad|product|category|cat)($|_|id)", re.I)
_SEPARATORS = ("|", ";", ",")


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
    paths: list[str], rows: int = 100_000, hash_above: int = 100_000
) -> tuple[dict, list, list[str]]:
    """(spec dict, per-file column descriptions, notes for the user)."""
    tables, hows, descs = [], [], []
    for p in paths:
        t, how = read_sample(p, rows)
        tables.append(t)
        hows.append(how)
        descs.append(describe(t))
    main = descs[0]
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
    label = _label(main)
    if label is None:
        raise ValueError(f"{paths[0]}: no label column found (name one label/click/y, or edit)")
    time_col = next(
        (c for c in main if _TIME_NAMES.search(c["name"]) and c["type"] in ("int", "float")), None
    )
    notes = []
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
    ap.add_argument("--out", default="", help="write the proposed spec here (else stdout)")
    args = ap.parse_args(argv)
    try:
        spec, descs, notes = propose(args.files, args.rows, args.hash_above)
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
        console.print(
            f"wrote {args.out}: edit it, then train with --data.kind tabular "
            f"--data.tabular.spec {args.out}"
        )
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
