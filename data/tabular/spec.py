"""The feature spec: what a tabular CTR dataset's columns are and how each becomes model input.

A spec is a typed config (frozen dataclasses, no jax import), written in Python or loaded from a
small YAML, JSON or TOML file with :func:`load_spec`. Paths in a spec file are relative to the
file's folder. Example (YAML)::

    name: movielens
    train: [ratings.csv]                  # files or globs, read in sorted order
    format: {delimiter: ",", header: true}
    joins:                                # side tables, joined on a key as rows are read
      - {path: [users.csv], key: user_id}
      - {path: [movies.csv], key: movie_id, columns: [genres]}
    split: {kind: random, valid_fraction: 0.1, seed: 0}
    label: {column: rating, threshold: 4}     # label = rating >= 4
    features:
      - {name: user_id, kind: categorical}
      - {name: movie_id, kind: categorical, min_count: 2}
      - {name: genres, kind: multi_categorical, separator: "|", max_hotness: 6}
      - {name: age, kind: numeric, standardize: true}
      - {name: age_bucket, column: age, kind: numeric, boundaries: [18, 25, 35, 45]}

How columns become a :class:`~data.batch.Batch` (``data/tabular/encode.py`` implements it):

* ``categorical``: one id per row. ``hash_buckets == 0``: a vocabulary of the training split's
  values seen at least ``min_count`` times, sorted (numerically with ``parse: int``), mapped to
  ``1..n``; id 0 is the out-of-vocabulary bucket (missing, rare and unseen values). With
  ``hash_buckets = V``: id ``1 + h mod (V - 1)`` of a fixed seeded hash ``h`` (the Criteo
  reader's splitmix64, so the Criteo preset gives that reader's ids), 0 for a missing value.
* ``multi_categorical``: the column is a token list split on ``separator``, a bag of up to
  ``max_hotness`` ids (left-aligned, pad -1); tokens beyond ``max_hotness`` are cut and counted.
* ``numeric``: ``clip`` to ``[lo, hi]``, then ``log`` (``sign(x) * log1p(|x|)``), then
  ``standardize`` by the training split's mean and standard deviation; a missing value becomes
  ``fill`` (after the transforms). With ``boundaries`` the value is bucketised instead and becomes
  a sparse feature: id 0 missing, ``1 + searchsorted(boundaries, x, side="right")``.
* Features with the same ``table`` share one vocabulary (or hash) and one embedding table.

Dense features are the numeric ones without ``boundaries``, in spec order; sparse features are
all others, in spec order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from data import strict

FORMAT_VERSION = 2
"""Bumped when prepared data's layout or encoding changes (part of every fingerprint). 2: an
integer column with hex or 19-digit values is checked by the rule, not pyarrow's cast."""


class SpecError(ValueError):
    """A spec breaks its schema; the message names the file and the field's path."""


MAX_HOTNESS = 1024
"""Bound of a feature's ``max_hotness``. Records are fixed-width and every sparse feature's bag
is padded to the spec's largest ``max_hotness``, so one feature of H slots makes every example
carry ``4 * F * H`` bytes of ids (F sparse features): at 1,024 slots and Criteo's 26 features,
106 KiB per example and 4.2 GiB for the ids of one 4 MiB CSV chunk of 100-byte rows. A list
longer than that is a sequence for a sequence model, not a bag to pool."""

MAX_NAME_BYTES = 200
"""Bound of a spec's ``name`` in UTF-8 bytes: the prepared folder ``<name>-<16 hex>`` must stay
within the 255 bytes a file name may have."""


def _check_name(name: str) -> None:
    """``name`` must be one plain folder name: it names a folder under the prepared-data root,
    so a separator, ``..`` or an absolute path would write outside it."""
    bad = (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
        or len(name.encode()) > MAX_NAME_BYTES
    )
    if bad:
        raise SpecError(
            f"name: {name[:80]!r} is not a plain folder name (it names the prepared folder: "
            f"no '/' or '\\', not '.' or '..', no control character, 1 to {MAX_NAME_BYTES} bytes)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileFormat:
    """How to read a set of files."""

    kind: Literal["auto", "csv", "parquet"] = "auto"
    """``auto``: ``.parquet``/``.pq`` files are Parquet, everything else is CSV (``.gz``,
    ``.bz2``, ``.zst`` are decompressed)."""
    delimiter: str = ""
    """CSV field separator; '' = tab for names containing ``.tsv``, else comma."""
    header: bool = True
    """CSV: the first line holds the column names."""
    column_names: tuple[str, ...] = ()
    """CSV column names when ``header`` is false (required then)."""
    quote_char: str = '"'
    """CSV quote character; '' disables quoting."""
    null_values: tuple[str, ...] = ("",)
    """CSV strings that mean a missing value."""

    def __post_init__(self):
        if not self.header and not self.column_names and self.kind != "parquet":
            raise SpecError("format: header is false, so column_names must list the columns")
        if self.header and self.column_names:
            raise SpecError("format: column_names is only for files without a header")
        if len(self.delimiter) > 1 or len(self.quote_char) > 1:
            raise SpecError("format: delimiter and quote_char are single characters")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Join:
    """A side table (e.g. user or item features) joined to every interaction row on a key."""

    path: tuple[str, ...]
    """The side table's files (or globs); held in memory while the data is read."""
    key: str
    """Key column of the interactions."""
    right_key: str = ""
    """Key column of the side table ('' = same name as ``key``); its values must be unique."""
    columns: tuple[str, ...] = ()
    """Side-table columns to add (empty = all but the key); names must not clash."""
    format: FileFormat = FileFormat()
    """How to read the side table's files."""

    def __post_init__(self):
        if not self.path:
            raise SpecError(f"join on {self.key!r}: path lists no file")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split:
    """Which rows are training, validation and test."""

    kind: Literal["random", "time", "files"] = "random"
    """``random``: each row by a seeded hash of (file, row); ``time``: by a time column against
    cutoffs; ``files``: the spec's ``valid`` and ``test`` files (``train`` is all training)."""
    valid_fraction: float = 0.1
    """``random``: share of rows for validation."""
    test_fraction: float = 0.0
    """``random``: share of rows for test."""
    seed: int = 0
    """``random``: seed of the row hash."""
    column: str = ""
    """``time``: the (numeric) time column."""
    valid_from: float | None = None
    """``time``: rows with time >= this are validation (< ``test_from``)."""
    test_from: float | None = None
    """``time``: rows with time >= this are test (None: no test split)."""

    def __post_init__(self):
        if self.kind == "random":
            if not (0 <= self.valid_fraction and 0 <= self.test_fraction) or (
                self.valid_fraction + self.test_fraction >= 1
            ):
                raise SpecError(
                    "split: valid_fraction and test_fraction must be >= 0 and sum below 1"
                )
        if self.kind == "time":
            if not self.column or self.valid_from is None:
                raise SpecError("split kind time needs column and valid_from")
            if self.test_from is not None and self.test_from < self.valid_from:
                raise SpecError("split: test_from must be >= valid_from")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Label:
    """The binary label."""

    column: str
    """Label column."""
    threshold: float | None = None
    """None: the column must hold 0 or 1. A number: label = (value >= threshold)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Feature:
    """One model input built from one column (see the module docstring)."""

    name: str
    """Feature name (unique)."""
    kind: Literal["categorical", "multi_categorical", "numeric"]
    """Column kind."""
    column: str = ""
    """Source column ('' = ``name``); several features may read one column."""
    parse: Literal["string", "int", "hex"] = "string"
    """Categorical values as strings, base-10 integers (sorted numerically), or hex integers
    (Criteo's categoricals); a value that does not parse is a bad row."""
    min_count: int = 1
    """Vocabulary: training-split occurrences a value needs for its own id."""
    hash_buckets: int = 0
    """0: vocabulary from the training split. V > 0: hash into V rows (0 = missing)."""
    hash_seed: int = 0
    """Seed of the hash (``hash_buckets > 0``)."""
    table: str = ""
    """Embedding table ('' = ``name``): features naming one table share its ids and rows."""
    separator: str = "|"
    """``multi_categorical``: token separator."""
    max_hotness: int = 1
    """``multi_categorical``: bag slots (1 to 1,024); longer lists are cut (counted)."""
    dtype: Literal["float", "int"] = "float"
    """``numeric``: ``int`` rejects a value that is not a base-10 integer."""
    clip: tuple[float, float] | None = None
    """``numeric``: clip raw values to ``[lo, hi]`` first."""
    log: bool = False
    """``numeric``: ``sign(x) * log1p(|x|)`` after clipping."""
    standardize: bool = False
    """``numeric``: subtract the training mean, divide by its standard deviation (last)."""
    fill: float = 0.0
    """``numeric``: value of a missing entry (after the transforms)."""
    boundaries: tuple[float, ...] = ()
    """``numeric``: non-empty bucketises the value into a sparse feature."""

    def __post_init__(self):
        where = f"feature {self.name!r}"
        if not self.name:
            raise SpecError("a feature has an empty name")
        if self.kind not in ("categorical", "multi_categorical", "numeric"):
            raise SpecError(f"{where}: unknown kind {self.kind!r}")
        if self.min_count < 1 or self.hash_buckets < 0 or self.max_hotness < 1:
            raise SpecError(f"{where}: min_count and max_hotness must be >= 1, hash_buckets >= 0")
        if self.kind == "multi_categorical" and not self.separator:
            raise SpecError(f"{where}: multi_categorical needs a separator")
        if self.max_hotness > MAX_HOTNESS:
            raise SpecError(
                f"{where}: max_hotness {self.max_hotness} is above {MAX_HOTNESS} (every "
                "example's record holds that many id slots per sparse feature)"
            )
        if self.kind != "multi_categorical" and self.max_hotness != 1:
            raise SpecError(f"{where}: max_hotness applies to multi_categorical features")
        if list(self.boundaries) != sorted(set(self.boundaries)):
            raise SpecError(f"{where}: boundaries must be strictly increasing")
        if self.clip is not None and not self.clip[0] <= self.clip[1]:
            raise SpecError(f"{where}: clip must be [lo, hi] with lo <= hi")
        if self.boundaries and (self.clip or self.log or self.standardize):
            raise SpecError(
                f"{where}: boundaries bucketise the raw value; clip, log and standardize apply "
                "to dense values only (give the boundaries on the raw scale)"
            )
        if self.kind != "numeric" and (
            self.boundaries or self.clip or self.log or self.standardize
        ):
            raise SpecError(f"{where}: clip, log, standardize, boundaries are numeric options")

    @property
    def source(self) -> str:
        return self.column or self.name

    @property
    def sparse(self) -> bool:
        """Whether the feature is an id bag (else a dense value)."""
        return self.kind != "numeric" or bool(self.boundaries)

    @property
    def table_name(self) -> str:
        return self.table or self.name


@dataclasses.dataclass(frozen=True, kw_only=True)
class TabularSpec:
    """A tabular CTR dataset: files, joins, split, label, weight and features."""

    name: str = "tabular"
    """Dataset name (names the prepared folder ``<root>/<name>-<fingerprint>``, so one plain
    folder name: no separator, ``..`` or control character)."""
    train: tuple[str, ...]
    """Interaction files or globs; with split kind ``files`` these are all training rows."""
    valid: tuple[str, ...] = ()
    """Split kind ``files``: validation files."""
    test: tuple[str, ...] = ()
    """Split kind ``files``: test files."""
    format: FileFormat = FileFormat()
    """How to read the interaction files."""
    joins: tuple[Join, ...] = ()
    """Side tables joined on keys."""
    split: Split = Split()
    """Train / validation / test assignment."""
    label: Label
    """The binary label."""
    weight: str = ""
    """Optional example-weight column (non-negative numbers; '' = every example weighs 1)."""
    features: tuple[Feature, ...]
    """Model inputs, in order."""
    strict: bool = True
    """Strict: the first bad row raises naming file, line and column. Lenient: bad rows are
    written to a rejects file and counted by reason; nothing is dropped silently."""
    rows_per_shard: int = 1 << 20
    """Examples per array_record shard (also the unit of resumption after a kill)."""
    piece_bytes: int = 256 << 20
    """Uncompressed CSV files larger than this are cut at line ends into pieces of about this
    size, prepared by parallel processes (the random split hashes (file, piece, row), so this
    is part of the spec)."""
    base_dir: str = ""
    """Folder relative paths are resolved against (set by :func:`load_spec` to the file's)."""

    def __post_init__(self):
        _check_name(self.name)
        if not self.train:
            raise SpecError("train lists no file")
        if not self.features:
            raise SpecError("features is empty")
        if not any(f.sparse for f in self.features):
            raise SpecError(
                "features: the models need at least one sparse feature (categorical, "
                "multi_categorical, or numeric with boundaries)"
            )
        names = [f.name for f in self.features]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SpecError(f"feature names must be unique, repeated: {dup}")
        if self.split.kind == "files" and not self.valid:
            raise SpecError("split kind files needs valid files")
        if self.split.kind != "files" and (self.valid or self.test):
            raise SpecError(f"valid/test files are given but split kind is {self.split.kind!r}")
        if self.rows_per_shard < 1 or self.piece_bytes < 1:
            raise SpecError("rows_per_shard and piece_bytes must be >= 1")
        by_table: dict[str, Feature] = {}
        for f in self.features:
            if not f.sparse:
                continue
            other = by_table.setdefault(f.table_name, f)
            if (other.hash_buckets, other.hash_seed, other.parse, other.min_count) != (
                f.hash_buckets,
                f.hash_seed,
                f.parse,
                f.min_count,
            ) or (other.boundaries != f.boundaries):
                raise SpecError(
                    f"features {other.name!r} and {f.name!r} share table {f.table_name!r} but "
                    "differ in parse, min_count, hash_buckets, hash_seed or boundaries"
                )

    # --------------------------------------------------------------------- derived

    @property
    def dense_features(self) -> tuple[Feature, ...]:
        return tuple(f for f in self.features if not f.sparse)

    @property
    def sparse_features(self) -> tuple[Feature, ...]:
        return tuple(f for f in self.features if f.sparse)

    @property
    def tables(self) -> tuple[str, ...]:
        """Distinct table names of the sparse features, in first-use order."""
        return tuple(dict.fromkeys(f.table_name for f in self.sparse_features))

    def resolve(self, path: str) -> str:
        p = os.path.expanduser(path)
        return p if os.path.isabs(p) else os.path.join(self.base_dir or ".", p)

    def needed_columns(self) -> tuple[str, ...]:
        """Every column the features, label, weight, time split and join keys read."""
        need = [self.label.column, *(f.source for f in self.features)]
        need += [self.weight] if self.weight else []
        need += [self.split.column] if self.split.kind == "time" else []
        need += [j.key for j in self.joins]
        return tuple(dict.fromkeys(need))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("base_dir")
        return d


# ----------------------------------------------------------------------------- loading


def spec_from_dict(data: Any, *, where: str = "spec", base_dir: str = "") -> TabularSpec:
    """A :class:`TabularSpec` from plain data (parsed YAML/JSON/TOML).

    Raises:
      SpecError: an unknown or missing field, or a value of the wrong type, naming ``where``
        and the field's path (e.g. ``spec.yaml: features[2].separator``).
    """
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    data = {**data, "base_dir": base_dir}
    try:
        return strict.build(TabularSpec, data, error=SpecError, str_as_list=True)
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None


def read_spec_file(path: str | os.PathLike) -> tuple[Any, str]:
    """The plain data of a ``.yaml``/``.yml``, ``.json`` or ``.toml`` spec file and the folder
    its relative paths are resolved against (shared by the CTR and the sequence spec)."""
    path = os.fspath(path)
    suffix = Path(path).suffix.lower()
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError(f"{path}: cannot read the spec ({e.strerror})") from None
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            raise SpecError(f"{path}: spec files end in .yaml, .yml, .json or .toml")
    except SpecError:
        raise
    except Exception as e:  # the parsers' own errors carry line and column
        raise SpecError(f"{path}: not valid {suffix[1:]}: {e}") from None
    return data, os.path.dirname(os.path.abspath(path))


def load_spec(path: str | os.PathLike) -> TabularSpec:
    """Loads a spec from a ``.yaml``/``.yml``, ``.json`` or ``.toml`` file (paths inside it are
    relative to its folder)."""
    path = os.fspath(path)
    data, base_dir = read_spec_file(path)
    if isinstance(data, dict) and "sequence" in data:
        raise SpecError(
            f"{path}: a sequence spec (it has a sequence section): the sequential families read "
            "it (python -m sequential.sasrec.train ... --data.kind tabular --data.tabular.spec "
            f"{path}), the CTR families need label and features"
        )
    return spec_from_dict(data, where=path, base_dir=base_dir)


def spec_digest(spec: TabularSpec) -> str:
    """SHA-256 of the spec's canonical JSON and the format version (files are hashed apart)."""
    text = json.dumps({"v": FORMAT_VERSION, "spec": spec.to_dict()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()
