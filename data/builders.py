"""Building the data source a :class:`~data.config.DataConfig` describes (:func:`make_source`),
by route: raw Frappe and Criteo files parsed into an :class:`~data.sources.InMemorySource`; with
``DataConfig.tfds_data_dir``, a prepared tfds array_record dataset read by random access through
a :class:`~data.sources.RandomAccessSource` (same batches for the same files and settings); a
feature spec's data (``data.kind=tabular``) prepared into array_record shards on first use; and
generated examples (:class:`~data.sources.SyntheticSource`).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import operator
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.batch import Batch
from data.config import DataConfig
from data.record_files import ArrayRecordFiles
from data.sources import DataSource, InMemorySource, RandomAccessSource, SyntheticSource


def _eval_path(cfg: DataConfig, eval_path: str | None) -> str:
    path = eval_path or cfg.eval_path
    if not path:
        raise ValueError(f"data.kind={cfg.kind!r} needs an eval file: set data.eval_path")
    return path


def _make_frappe(
    cfg: DataConfig, eval_path: str, *, eval_only: bool = False, **kw
) -> InMemorySource:
    from data.frappe.reader import build_frappe_vocab, frappe_schema, read_frappe
    from data.tabular.serving import frappe_encoding

    vocab = build_frappe_vocab(cfg.train_path)  # the vocabulary always comes from training
    train_rows, train_stats = (None, None) if eval_only else read_frappe(cfg.train_path, vocab)
    eval_rows, eval_stats = read_frappe(eval_path, vocab)
    stats = {
        "kind": "frappe",
        "vocab_sizes": list(vocab.vocab_sizes),
        "train": train_stats.as_dict() if train_stats else None,
        "eval": eval_stats.as_dict(),
    }
    source = InMemorySource(frappe_schema(vocab), train_rows, eval_rows, stats=stats, **kw)
    source.serving_encoding = functools.partial(frappe_encoding, vocab.values)  # for exports
    return source


def _criteo_rejects(cfg: DataConfig, rejects_dir: str | None) -> tuple[str | None, str | None]:
    """Rejects files of lenient Criteo reading: (train, eval); None in strict mode."""
    rejects = None  # strict mode, or lenient with no file: read_criteo raises a clear error
    if not cfg.criteo.strict:
        rejects = cfg.criteo.rejects_path or (
            os.path.join(rejects_dir, "criteo_rejects.tsv") if rejects_dir else None
        )
    # The reader truncates its rejects file, so eval rejects go to a sibling file.
    eval_rejects = None
    if rejects:
        p = Path(rejects)
        eval_rejects = str(p.with_name(f"{p.stem}.eval{p.suffix}"))
    return rejects, eval_rejects


def _make_criteo(
    cfg: DataConfig, eval_path: str, rejects_dir: str | None, *, eval_only: bool = False, **kw
) -> InMemorySource:
    from data.criteo.reader import criteo_schema, read_criteo

    rejects, eval_rejects = _criteo_rejects(cfg, rejects_dir)
    if eval_only:
        train_rows = train_stats = None
    else:
        train_rows, train_stats = read_criteo(cfg.train_path, cfg.criteo, rejects_path=rejects)
    eval_rows, eval_stats = read_criteo(eval_path, cfg.criteo, rejects_path=eval_rejects)
    stats = {
        "kind": "criteo",
        "train": dataclasses.asdict(train_stats) if train_stats else None,
        "eval": dataclasses.asdict(eval_stats),
        "report": (f"train {train_stats.report()}; " if train_stats else "")
        + f"eval {eval_stats.report()}",
    }
    source = InMemorySource(
        criteo_schema(cfg.criteo.vocab_sizes), train_rows, eval_rows, stats=stats, **kw
    )
    source.serving_encoding = _criteo_encoding(cfg)  # for exported models
    return source


def _criteo_encoding(cfg: DataConfig):
    from data.tabular.serving import criteo_encoding

    return functools.partial(criteo_encoding, cfg.criteo.vocab_sizes, cfg.criteo.hash_seed)


# ----------------------------------------------------------------------------- tfds route


def _abspath(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _same_file(a: str, b: str) -> bool:
    return os.path.realpath(_abspath(a)) == os.path.realpath(_abspath(b))


def _eval_split(
    split_files: dict[str, str], default: str | None, path: str
) -> tuple[str | None, str | None]:
    """(prepared split, raw file) evaluation reads: the split made of exactly file ``path``,
    else ``path`` itself (read into memory); ``default`` when ``path`` is empty."""
    if not path:
        if default is None:
            raise ValueError("no eval file given and the tfds dataset has no validation split")
        return default, None
    for split, file in split_files.items():
        if _same_file(path, file):
            return split, None
    return None, path


def _prepare(builder, manual_dir: str) -> None:
    """Prepares ``builder``'s dataset as array_record from ``manual_dir`` unless it exists."""
    import tensorflow_datasets as tfds

    if builder.is_prepared():
        return
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(manual_dir=manual_dir),
    )


class _ExampleDecoder:
    """Serialized tfds examples -> one stacked array per feature (fixed-shape numeric tensors).

    The records (see :class:`_ArrayRecordSplit`) are ``tf.train.Example`` protos. tfds' own
    decoding converts every feature of every record to numpy separately (about 70 us per
    Criteo record); parsing each proto here and converting each feature once per batch gives
    the same values in about 10 us.
    """

    def __init__(self, features):
        from tensorflow_datasets.proto import tf_example_pb2

        self._parse = tf_example_pb2.Example.FromString
        self._fields: list[tuple[str, Callable, tuple[int, ...], np.dtype]] = []
        for name, info in features.get_tensor_info().items():
            shape = tuple(getattr(info, "shape", (None,)))
            dtype = np.dtype(getattr(info, "np_dtype", object))
            if None in shape or dtype.kind not in "iuf":
                raise ValueError(f"tfds feature {name!r} ({info}) is not a fixed-shape number")
            kind = "float_list" if dtype.kind == "f" else "int64_list"
            self._fields.append((name, operator.attrgetter(f"{kind}.value"), shape, dtype))

    def __call__(self, records: Sequence[bytes]) -> dict[str, np.ndarray]:
        values: dict[str, list] = {name: [] for name, *_ in self._fields}
        take = [(name, values[name].extend, get) for name, get, _, _ in self._fields]
        for record in records:
            feature = self._parse(record).features.feature
            for name, extend, get in take:
                extend(get(feature[name]))
        n = len(records)
        out = {}
        for name, _, shape, dtype in self._fields:
            arr = np.asarray(values[name], dtype)
            if arr.size != n * int(np.prod(shape)):
                raise ValueError(f"tfds records hold {arr.size} values of {name!r} for {n} records")
            out[name] = arr.reshape(n, *shape)
        return out


class _ArrayRecordSplit(ArrayRecordFiles):
    """The serialized records of one prepared tfds split (the same records as
    ``builder.as_data_source(split, deserialize_method=RAW_BYTES)``)."""

    def __init__(self, builder, split: str):
        instructions = builder.info.splits[split].file_instructions
        super().__init__(
            [fi.filename for fi in instructions],
            [fi.take for fi in instructions],
            [fi.skip for fi in instructions],
        )


def _ones_batch(dense_bn: np.ndarray, ids_bf: np.ndarray, labels_b: np.ndarray) -> Batch:
    return Batch(dense_bn, ids_bf[:, :, None], labels_b, np.ones(labels_b.shape, np.float32))


def _tfds_stats(cfg: DataConfig, builder, train, eval_split: str | None, eval_file: str | None):
    return {
        "kind": cfg.kind,
        "tfds": {
            "data_dir": cfg.tfds_data_dir,
            "dataset": os.fspath(builder.data_path),
            "train_split": "train",
            "num_train_examples": len(train),
            "eval": f"split {eval_split}" if eval_split else f"raw file {eval_file} (in memory)",
        },
    }


def _make_frappe_tfds(cfg: DataConfig, eval_path: str | None, **kw) -> RandomAccessSource:
    from data.frappe.reader import frappe_schema, read_frappe
    from data.tabular.serving import frappe_encoding
    from data.tfds_builders.frappe import FrappeBars, frappe_bars_vocab

    train_path = _abspath(cfg.train_path)
    manual = os.path.dirname(train_path)
    if os.path.basename(train_path) != "train.csv":
        raise ValueError(
            f"data.tfds_data_dir reads Frappe from the folder of data.train_path, whose training "
            f"file must be named train.csv (the frappe_bars builder's layout); got {train_path}"
        )
    builder = FrappeBars(data_dir=_abspath(cfg.tfds_data_dir), file_format="array_record")
    _prepare(builder, manual)
    vocab = frappe_bars_vocab(builder)
    names = {"train": "train.csv", "validation": "valid.csv", "test": "test.csv"}
    split_files = {
        split: os.path.join(manual, name)
        for split, name in names.items()
        if split in builder.info.splits
    }
    eval_split, eval_file = _eval_split(split_files, "validation", eval_path or cfg.eval_path)
    train = _ArrayRecordSplit(builder, "train")
    decode = _ExampleDecoder(builder.info.features)

    def to_batch(records: Sequence[bytes]) -> Batch:
        cols = decode(records)
        return _ones_batch(np.zeros((len(records), 0), np.float32), cols["ids"], cols["label"])

    stats = _tfds_stats(cfg, builder, train, eval_split, eval_file)
    stats["vocab_sizes"] = list(vocab.vocab_sizes)
    if eval_split:
        evals: Sequence[bytes] | Batch = _ArrayRecordSplit(builder, eval_split)
        stats["eval"] = {"oov": builder.info.metadata["oov"][eval_split]}
    else:
        evals, eval_stats = read_frappe(eval_file, vocab)
        stats["eval"] = eval_stats.as_dict()
    source = RandomAccessSource(
        frappe_schema(vocab), train, evals, to_batch=to_batch, stats=stats, **kw
    )
    source.serving_encoding = functools.partial(frappe_encoding, vocab.values)  # for exports
    return source


def _criteo_tfds_config(cfg: DataConfig):
    """The ``criteo_raw`` builder config ``cfg`` reads, and which raw file makes which split.

    The config's name comes from the file layout only; the hashing parameters are stored as JSON
    in its description (persisted in ``dataset_info.json``) and checked by
    :func:`_check_criteo_params`, so a changed ``hash_seed`` is an error, not a silent (and for
    Criteo, hours-long) preparation of a second copy.

    Returns:
      ``(config, params, split_files, default_eval_split)``.
    """
    from data.tfds_builders.criteo import CriteoRawConfig

    train_path = _abspath(cfg.train_path)
    manual, train_name = os.path.split(train_path)
    eval_file = _abspath(cfg.eval_path) if cfg.eval_path else ""
    split_files = {"train": train_path}
    val_patterns: tuple[str, ...] = ()
    denominator = 0
    if not eval_file:
        validation, split_files, denominator = "last 1/7 of train", {}, 7
    elif _same_file(eval_file, train_path) or os.path.dirname(eval_file) != manual:
        validation = ""  # evaluation reads split train, or the raw file in memory
    else:
        validation = os.path.basename(eval_file)
        split_files["validation"] = eval_file
        val_patterns = (glob.escape(validation),)
    layout = {"train": train_name, "validation": validation}
    slug = re.sub(r"[^a-z0-9]+", "_", f"{train_name} {validation or 'none'}".lower()).strip("_")
    digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:8]
    params = {
        "vocab_sizes": [int(v) for v in cfg.criteo.vocab_sizes],
        "hash_seed": int(cfg.criteo.hash_seed),
        "max_rows": int(cfg.criteo.max_rows),
    }
    config = CriteoRawConfig(
        name=f"{slug[:48]}_{digest}",
        description=json.dumps({"files": layout, "params": params}, sort_keys=True),
        vocab_sizes=tuple(params["vocab_sizes"]),
        hash_seed=params["hash_seed"],
        max_rows=params["max_rows"],
        train_patterns=(glob.escape(train_name),),
        validation_patterns=val_patterns,
        validation_denominator=denominator,
    )
    return config, params, split_files, "validation" if denominator else None


def _check_criteo_params(builder, params: dict[str, Any]) -> None:
    """Raises unless the prepared dataset was hashed with ``params`` (naming both)."""
    where = os.fspath(builder.data_path)
    try:
        stored = json.loads(builder.info.config_description or "")["params"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"tfds dataset {where} records no recscale hashing parameters "
            f"(description {builder.info.config_description!r}); delete it to prepare it again"
        ) from None
    if stored != params:
        diff = "; ".join(
            f"{k}: prepared {stored.get(k)}, config {params[k]}"
            for k in params
            if stored.get(k) != params[k]
        )
        raise ValueError(
            f"tfds dataset {where} was prepared with other Criteo hashing parameters than "
            f"data.criteo asks for ({diff}). Set data.tfds_data_dir to another folder, or delete "
            f"{where} to prepare it again with the config's parameters."
        )


def _make_criteo_tfds(
    cfg: DataConfig, eval_path: str | None, rejects_dir: str | None, **kw
) -> RandomAccessSource:
    from data.criteo.reader import criteo_schema, read_criteo
    from data.tfds_builders.criteo import CriteoRaw

    config, params, split_files, default = _criteo_tfds_config(cfg)
    builder = CriteoRaw(
        data_dir=_abspath(cfg.tfds_data_dir), config=config, file_format="array_record"
    )
    if builder.is_prepared():
        _check_criteo_params(builder, params)
    else:
        for split, file in split_files.items():  # the builder would just find no rows
            if not os.path.isfile(file):
                raise FileNotFoundError(f"Criteo {split} file {file} not found")
        _prepare(builder, os.path.dirname(_abspath(cfg.train_path)))
    eval_split, eval_file = _eval_split(split_files, default, eval_path or cfg.eval_path)
    train = _ArrayRecordSplit(builder, "train")
    decode = _ExampleDecoder(builder.info.features)

    def to_batch(records: Sequence[bytes]) -> Batch:
        cols = decode(records)
        return _ones_batch(cols["dense"], cols["ids"], cols["label"])

    stats = _tfds_stats(cfg, builder, train, eval_split, eval_file)
    if eval_split:
        evals: Sequence[bytes] | Batch = _ArrayRecordSplit(builder, eval_split)
        stats["report"] = (
            f"criteo tfds {builder.data_path}: train {len(train)} rows; "
            f"eval split {eval_split} {len(evals)} rows"
        )
    else:
        _, eval_rejects = _criteo_rejects(cfg, rejects_dir)
        evals, eval_stats = read_criteo(eval_file, cfg.criteo, rejects_path=eval_rejects)
        stats["eval"] = dataclasses.asdict(eval_stats)
        stats["report"] = (
            f"criteo tfds {builder.data_path}: train {len(train)} rows; eval {eval_stats.report()}"
        )
    source = RandomAccessSource(
        criteo_schema(cfg.criteo.vocab_sizes), train, evals, to_batch=to_batch, stats=stats, **kw
    )
    source.serving_encoding = _criteo_encoding(cfg)  # for exported models
    return source


def make_source(
    cfg: DataConfig,
    *,
    process_index: int = 0,
    process_count: int = 1,
    eval_path: str | None = None,
    rejects_dir: str | None = None,
    eval_only: bool = False,
) -> DataSource:
    """Builds the data source ``cfg`` describes, for host ``process_index`` of ``process_count``.

    Frappe and Criteo are parsed into memory (:class:`InMemorySource`), or with
    ``cfg.tfds_data_dir`` read from a tfds array_record dataset prepared there on first use
    (:class:`RandomAccessSource`; see ``DataConfig.tfds_data_dir`` for the splits).

    Args:
      cfg: dataset kind, files, global batch sizes and shuffle seed.
      eval_path: overrides ``cfg.eval_path`` (e.g. a test file). With ``cfg.tfds_data_dir``, a
        file that is not one of the prepared splits is read raw into memory.
      rejects_dir: lenient Criteo reading writes rejected rows to
        ``<rejects_dir>/criteo_rejects.tsv`` (train) and ``criteo_rejects.eval.tsv`` (eval)
        unless ``cfg.criteo.rejects_path`` is set (then the eval file is its ``.eval`` sibling).
      eval_only: do not read training rows (checkpoint evaluation); Frappe still reads the
        training file's vocabulary. ``train_batch`` then raises.

    Returns:
      A :class:`DataSource`; its ``stats`` dict holds the readers' counters for logging.

    Raises:
      ValueError: a missing eval file; with ``cfg.tfds_data_dir``, a Frappe train file not
        named ``train.csv`` or a prepared Criteo dataset hashed with other parameters.
    """
    if cfg.kind == "synthetic":
        if eval_path:
            raise ValueError(
                f"eval_path {eval_path!r} given for synthetic data, whose eval set is generated"
            )
        return SyntheticSource(cfg, process_index=process_index, process_count=process_count)
    kw = dict(
        batch_size=cfg.batch_size,
        eval_batch_size=cfg.eval_batch_size,
        seed=cfg.shuffle_seed,
        process_index=process_index,
        process_count=process_count,
        id_policy=cfg.id_policy,
    )
    if cfg.kind == "frappe":
        if cfg.tfds_data_dir:
            return _make_frappe_tfds(cfg, eval_path, **kw)
        return _make_frappe(cfg, _eval_path(cfg, eval_path), eval_only=eval_only, **kw)
    if cfg.kind == "criteo":
        if cfg.tfds_data_dir:
            return _make_criteo_tfds(cfg, eval_path, rejects_dir, **kw)
        return _make_criteo(cfg, _eval_path(cfg, eval_path), rejects_dir, eval_only=eval_only, **kw)
    if cfg.kind == "tabular":
        return _make_tabular(cfg, eval_path or cfg.eval_path, **kw)
    raise ValueError(
        f"unknown data.kind {cfg.kind!r}; expected synthetic, frappe, criteo or tabular"
    )


def _make_tabular(cfg: DataConfig, eval_path: str, **kw) -> RandomAccessSource:
    """A feature spec's data: prepared into array_record shards on first use (every later run
    reuses them), read by random access; an explicit eval file is encoded in memory with the
    prepared vocabulary (its unseen values counted as OOV)."""
    from data.tabular.prepare import prepare

    p = prepare(
        cfg.tabular.spec,
        cfg.tabular.prepared_dir,
        workers=cfg.tabular.workers,
        progress=kw["process_index"] == 0,
    )
    stats: dict[str, Any] = {"kind": "tabular", "prepared": p.folder, **p.stats}
    if eval_path:
        evals, eval_stats = p.encode_file(eval_path)
        stats["eval"] = eval_stats
    else:
        evals = p.records(cfg.tabular.eval_split)
        stats["eval"] = {"split": cfg.tabular.eval_split}
    source = RandomAccessSource(
        p.schema, p.records("train"), evals, to_batch=p.to_batch, stats=stats, **kw
    )
    source.serving_encoding = p.serving_encoding  # for exported models
    return source
