"""tfds builder ``criteo_raw``: raw Criteo TSV(s) from a manual directory -> array_record.

Works without TensorFlow: prepare with ``file_format="array_record"`` and read back with
``builder.as_data_source()`` (random access, numpy records), e.g.::

    from data.tfds_builders.criteo import load_criteo_tfds, records_to_batch

    source = load_criteo_tfds("~/tfds", manual_dir="/data/criteo_kaggle", split="train")
    batch = records_to_batch(source[i] for i in range(4096))   # a data.Batch

or, equivalently, with tfds directly::

    import tensorflow_datasets as tfds
    import data.tfds_builders.criteo  # registers "criteo_raw"

    builder = tfds.builder("criteo_raw/kaggle", data_dir="~/tfds", file_format="array_record")
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(manual_dir="/data/criteo_kaggle"),
    )
    source = builder.as_data_source(split="train")

Records: ``{"dense": float32[13], "ids": int32[26], "label": float32[]}``, exactly what
:func:`data.criteo.read_criteo` returns for the same rows (``dense`` transformed, ``ids`` hashed
with the config's ``vocab_sizes`` and ``hash_seed``; see ``data/criteo/reader.py``). Rows keep
file order (shuffling is disabled: Criteo is time-ordered, and shuffling is the input pipeline's
job). Files are read in strict mode: a malformed row fails the build, naming file, line, column.

Files (``CriteoRawConfig``): the manual directory's files matching ``train_patterns`` (default:
``train.txt``, ``*.tsv``, ``day_*``, each also as ``.gz``), in natural order (``day_2`` before
``day_10``). Splits:
  * ``validation_patterns`` non-empty: matching files form ``validation`` and are not trained on;
  * otherwise ``validation_denominator = N > 0``: the last ``floor(rows / N)`` rows of the train
    files (in file order) form ``validation``, the rest ``train`` (deterministic; ``kaggle`` uses
    N = 7, about the last of the 7 days, as facebookresearch/dlrm holds out the last day);
  * otherwise there is only ``train``.

Configs: ``kaggle`` (Kaggle vocabulary sizes, N = 7) and ``terabyte`` (MLPerf-capped Terabyte
sizes, ``day_0``..``day_22`` train, ``day_23`` validation). Pass a ``CriteoRawConfig`` as
``config=`` for other choices. Preparing runs in one process at roughly tens of thousands of
rows per second (tfds serialises each example), so prepare Terabyte once and reuse it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from data.batch import Batch
from data.config import CRITEO_KAGGLE_VOCAB_SIZES, CRITEO_TERABYTE_VOCAB_SIZES, CriteoConfig
from data.criteo.reader import CRITEO_DENSE, CRITEO_SPARSE, count_criteo_rows, iter_criteo_chunks

DEFAULT_TRAIN_PATTERNS = ("train.txt", "train.txt.gz", "*.tsv", "*.tsv.gz", "day_*")
"""Manual-dir file name patterns read by default (``fnmatch``, file names only)."""


@dataclasses.dataclass(eq=False, kw_only=True)
class CriteoRawConfig(tfds.core.BuilderConfig):
    """Which raw files make which split, and how categoricals are hashed."""

    vocab_sizes: tuple[int, ...] = CRITEO_KAGGLE_VOCAB_SIZES
    """Hash buckets of C1..C26 (bucket 0 = missing)."""
    hash_seed: int = 0
    """Seed of the categorical hash."""
    train_patterns: tuple[str, ...] = DEFAULT_TRAIN_PATTERNS
    """``fnmatch`` patterns of manual-dir file names to read (natural order)."""
    validation_patterns: tuple[str, ...] = ()
    """Files matching these form the ``validation`` split (and are excluded from ``train``)."""
    validation_denominator: int = 0
    """N > 0 (without ``validation_patterns``): the last floor(rows / N) rows are ``validation``."""
    max_rows: int = 0
    """Read at most this many rows per file (0 = all); for smoke builds."""

    def __post_init__(self):
        CriteoConfig(vocab_sizes=tuple(self.vocab_sizes))  # validates the length
        if self.validation_denominator < 0:
            raise ValueError(
                f"validation_denominator must be >= 0, got {self.validation_denominator}"
            )

    def reader_config(self) -> CriteoConfig:
        """The strict reader config this builder reads with."""
        return CriteoConfig(
            vocab_sizes=tuple(self.vocab_sizes),
            hash_seed=self.hash_seed,
            strict=True,
            max_rows=self.max_rows,
        )


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _matching(manual_dir: str, patterns: Iterable[str]) -> list[str]:
    names = sorted(
        (
            n
            for n in os.listdir(manual_dir)
            if os.path.isfile(os.path.join(manual_dir, n))
            and any(fnmatch.fnmatchcase(n, p) for p in patterns)
        ),
        key=_natural_key,
    )
    return [os.path.join(manual_dir, n) for n in names]


class CriteoRaw(tfds.core.GeneratorBasedBuilder):
    """Criteo display-advertising logs from the raw TSV, hashed to fixed vocabularies."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: strict reader, splitmix64 hashing, signed log1p."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = """\
    Download the Criteo data yourself (its licence forbids redistribution) and place the raw
    files in the manual directory (`download_config=tfds.download.DownloadConfig(manual_dir=...)`,
    default `<data_dir>/downloads/manual/`):
      * kaggle: `train.txt` (or `train.txt.gz`) of the Criteo Display Advertising Challenge
        (https://ailab.criteo.com/ressources/ ; 45,840,617 rows);
      * terabyte: `day_0` .. `day_23` (optionally `.gz`) of the Criteo 1TB Click Logs.
    Each line: label, 13 integer and 26 hex categorical tab-separated columns.
    """
    BUILDER_CONFIGS = [
        CriteoRawConfig(
            name="kaggle",
            description="Kaggle Display Advertising Challenge train.txt; last 1/7 of rows = validation.",
            validation_denominator=7,
        ),
        CriteoRawConfig(
            name="terabyte",
            description="Criteo 1TB click logs; day_0..day_22 train, day_23 validation.",
            vocab_sizes=CRITEO_TERABYTE_VOCAB_SIZES,
            train_patterns=("day_*",),
            validation_patterns=("day_23", "day_23.gz"),
        ),
    ]

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # tfds 4.9.10's own code_path touches `importlib_resources`, which it declares only for
        # Python < 3.9 (tensorflow/datasets#11212), so preparing fails with ModuleNotFoundError
        # where it is not installed. The answer is simply this file.
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "dense": tfds.features.Tensor(shape=(len(CRITEO_DENSE),), dtype=np.float32),
                    "ids": tfds.features.Tensor(shape=(len(CRITEO_SPARSE),), dtype=np.int32),
                    "label": tfds.features.Tensor(shape=(), dtype=np.float32),
                }
            ),
            disable_shuffling=True,
            homepage="https://ailab.criteo.com/ressources/",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        cfg: CriteoRawConfig = self.builder_config
        manual_dir = os.fspath(dl_manager.manual_dir)
        val_files = _matching(manual_dir, cfg.validation_patterns)
        train_files = [f for f in _matching(manual_dir, cfg.train_patterns) if f not in val_files]
        if not train_files:
            raise FileNotFoundError(
                f"no Criteo files matching {cfg.train_patterns} in {manual_dir}; "
                f"see MANUAL_DOWNLOAD_INSTRUCTIONS"
            )
        if cfg.validation_patterns:
            return {
                "train": self._generate_examples(train_files, 0, None),
                "validation": self._generate_examples(val_files, 0, None),
            }
        if cfg.validation_denominator > 0:
            total = count_criteo_rows(train_files, cfg.reader_config())
            cut = total - total // cfg.validation_denominator
            return {
                "train": self._generate_examples(train_files, 0, cut),
                "validation": self._generate_examples(train_files, cut, None),
            }
        return {"train": self._generate_examples(train_files, 0, None)}

    def _generate_examples(
        self, files: list[str], start: int, stop: int | None
    ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """Rows ``[start, stop)`` of ``files`` concatenated, keyed by their global row index."""
        reader_cfg = self.builder_config.reader_config()
        row = 0
        for batch in iter_criteo_chunks(files, reader_cfg):
            b = batch.batch_size
            lo, hi = max(start - row, 0), b if stop is None else min(stop - row, b)
            for i in range(lo, hi):
                yield (
                    row + i,
                    {
                        "dense": batch.dense_bn[i],
                        "ids": batch.ids_bfh[i, :, 0],
                        "label": batch.labels_b[i],
                    },
                )
            row += b
            if stop is not None and row >= stop:
                return


def load_criteo_tfds(
    data_dir: str | os.PathLike,
    manual_dir: str | os.PathLike | None = None,
    split: str = "train",
    *,
    config: str | CriteoRawConfig = "kaggle",
):
    """Random-access source of ``criteo_raw`` records, preparing the dataset first if needed.

    Args:
      data_dir: tfds data directory (the prepared array_record files live under it).
      manual_dir: directory of the raw TSV(s); needed only if not prepared yet.
      split: tfds split, e.g. ``train``, ``validation``, ``train[:1000]``.
      config: a ``BUILDER_CONFIGS`` name or a ``CriteoRawConfig``.

    Returns:
      A sequence (``len``, ``[i]``, ``__getitems__``) of record dicts; see the module docstring.
    """
    builder = CriteoRaw(data_dir=os.fspath(data_dir), config=config, file_format="array_record")
    if manual_dir is not None:  # a no-op if already prepared
        builder.download_and_prepare(
            file_format="array_record",
            download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir)),
        )
    return builder.as_data_source(split=split)


def records_to_batch(records: Iterable[Mapping[str, Any]]) -> Batch:
    """Stacks ``criteo_raw`` records into a :class:`data.Batch` (ids ``[B, 26, 1]``, weights 1)."""
    records = list(records)
    if not records:
        raise ValueError("records_to_batch needs at least one record")
    dense = np.stack([np.asarray(r["dense"], np.float32) for r in records])
    ids = np.stack([np.asarray(r["ids"], np.int32) for r in records])[:, :, None]
    labels = np.asarray([r["label"] for r in records], np.float32)
    return Batch(dense, ids, labels, np.ones(len(records), np.float32))
