"""The project's two real datasets as feature specs: Frappe and raw Criteo (Kaggle or Terabyte).

Each gives the same batches as its dedicated reader (``data/frappe``, ``data/criteo``), checked by
``tests/data/test_tabular_presets.py``. ``python -m data.tabular.presets criteo --train
'day_*.gz' --out criteo_tb.yaml`` writes one as YAML to edit or train on (``--data.kind tabular
--data.tabular.spec criteo_tb.yaml``); globs such as Criteo Terabyte's ``day_0`` ... ``day_23``
are expanded in sorted order.

Where the spec path is looser than the Criteo reader (both reject and count, never drop): a
categorical must be 1 to 16 hex digits (the reader: exactly 8), an integer column 1 to 18 digits
(the reader: int32 range), and a reject names the line but not the reader's reason codes.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from data.config import CRITEO_KAGGLE_VOCAB_SIZES, CRITEO_TERABYTE_VOCAB_SIZES
from data.frappe.reader import FRAPPE_FIELDS
from data.tabular.spec import Feature, FileFormat, Label, Split, TabularSpec


def frappe_spec(directory: str, *, test: bool = False) -> TabularSpec:
    """BARS ``Frappe_x1``: ``train.csv`` / ``valid.csv`` (and ``test.csv``) of ``directory``;
    global ids per field mapped through a training vocabulary (id 0 = unseen), as the reader."""
    return TabularSpec(
        name="frappe",
        train=(os.path.join(directory, "train.csv"),),
        valid=(os.path.join(directory, "valid.csv"),),
        test=(os.path.join(directory, "test.csv"),) if test else (),
        split=Split(kind="files"),
        label=Label(column="label"),
        features=tuple(Feature(name=f, kind="categorical", parse="int") for f in FRAPPE_FIELDS),
    )


CRITEO_COLUMNS = ("label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))


def criteo_spec(
    train: tuple[str, ...],
    *,
    valid: tuple[str, ...] = (),
    vocab_sizes: tuple[int, ...] = CRITEO_KAGGLE_VOCAB_SIZES,
    hash_seed: int = 0,
    strict: bool = True,
    valid_fraction: float = 1 / 7,
    name: str = "criteo",
) -> TabularSpec:
    """Raw Criteo TSV (no header): ``sign(x) log1p|x|`` integers, hex categoricals hashed into
    ``vocab_sizes`` with the Criteo reader's hash. Without ``valid`` files a seeded random
    ``valid_fraction`` of rows is held out (the reader's route holds out the last seventh)."""
    dense = tuple(
        Feature(name=f"I{i}", kind="numeric", dtype="int", log=True) for i in range(1, 14)
    )
    sparse = tuple(
        Feature(name=f"C{i}", kind="categorical", parse="hex", hash_buckets=v, hash_seed=hash_seed)
        for i, v in enumerate(vocab_sizes, start=1)
    )
    return TabularSpec(
        name=name,
        train=tuple(train),
        valid=tuple(valid),
        format=FileFormat(header=False, column_names=CRITEO_COLUMNS, delimiter="\t"),
        split=Split(kind="files") if valid else Split(valid_fraction=valid_fraction),
        label=Label(column="label"),
        features=dense + sparse,
        strict=strict,
    )


def write_spec(spec: TabularSpec, path: str) -> None:
    """Writes ``spec`` as YAML (or JSON for a ``.json`` path), loadable by ``load_spec``."""
    import json

    import yaml

    data = _plain(spec.to_dict())
    with open(path, "w") as fh:
        if path.endswith(".json"):
            json.dump(data, fh, indent=1)
        else:
            yaml.safe_dump(data, fh, sort_keys=False, width=100)


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m data.tabular.presets", description=__doc__.split("\n")[0]
    )
    ap.add_argument("preset", choices=["frappe", "criteo"])
    ap.add_argument("--dir", default="../shared/data/frappe", help="frappe: the BARS folder")
    ap.add_argument("--train", nargs="*", default=[], help="criteo: training files or globs")
    ap.add_argument("--valid", nargs="*", default=[], help="criteo: validation files or globs")
    ap.add_argument("--terabyte", action="store_true", help="criteo: Terabyte table sizes")
    ap.add_argument("--out", required=True, help="spec file to write (.yaml or .json)")
    args = ap.parse_args(argv)
    if args.preset == "frappe":
        spec = frappe_spec(os.path.abspath(args.dir))
    else:
        if not args.train:
            ap.error("criteo needs --train")
        sizes = CRITEO_TERABYTE_VOCAB_SIZES if args.terabyte else CRITEO_KAGGLE_VOCAB_SIZES
        spec = criteo_spec(
            tuple(os.path.abspath(p) for p in args.train),
            valid=tuple(os.path.abspath(p) for p in args.valid),
            vocab_sizes=sizes,
        )
    write_spec(dataclasses.replace(spec), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
