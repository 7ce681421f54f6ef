"""TFDS builder ``frappe_bars``: the Frappe CTR dataset (BARS ``Frappe_x1``) from a manual dir.

Works without TensorFlow: prepare in the ``array_record`` format and read with random access::

    import tensorflow_datasets as tfds
    from data.tfds_builders.frappe import FrappeBars, frappe_bars_vocab

    builder = FrappeBars(data_dir="~/tensorflow_datasets", file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir="/path/to/frappe"))
    train = builder.as_data_source("train")      # len(train), train[i], train.__getitems__([...])
    schema = frappe_schema(frappe_bars_vocab(builder))

Records are ``{"ids": int32[10], "label": float32}`` in file order (shuffling is disabled, so
record ``i`` is CSV row ``i``; training order comes from ``data.pipeline``). ``ids`` are the
per-field indices of :mod:`data.frappe.reader` (vocabulary from ``train.csv``, 0 = unseen value).
The vocabulary and the per-split OOV counts are saved in the dataset's metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from data.batch import Batch
from data.frappe.reader import (
    FRAPPE_FIELDS,
    FrappeVocab,
    map_frappe_table,
    parse_frappe_csv,
)

_SPLIT_FILES = {"train": "train.csv", "validation": "valid.csv", "test": "test.csv"}


class FrappeBars(tfds.core.GeneratorBasedBuilder):
    """Frappe app-usage CTR data in the BARS ``Frappe_x1`` layout (10 categorical fields)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: ids mapped with the train-file vocabulary."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = """\
    Place the BARS Frappe_x1 CSV files in the manual dir: `train.csv` and `valid.csv` (and
    optionally `test.csv`), each with the header
    `label,user,item,daytime,weekday,isweekend,homework,cost,weather,country,city`.
    They are published by the BARS benchmark (https://github.com/reczoo/Datasets, Frappe_x1);
    the dataset licence forbids redistribution, so they are not downloaded automatically.
    """

    # tfds 4.9.10 computes `code_path` with a check that imports the `importlib_resources`
    # backport, which it only declares for Python < 3.9 (so it is absent here) and crashes in
    # download_and_prepare. The class attribute shadows that computation; the value is what
    # tfds' own fallback gives (this file); it is used only to look for a checksums.tsv.
    code_path = epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description="Frappe context-aware app recommendation logs as a CTR task.",
            features=tfds.features.FeaturesDict(
                {
                    "ids": tfds.features.Tensor(shape=(len(FRAPPE_FIELDS),), dtype=np.int32),
                    "label": tfds.features.Scalar(dtype=np.float32),
                }
            ),
            homepage="https://github.com/reczoo/BARS/tree/main/datasets/Frappe",
            # Keep CSV order: record i is row i (the training pipeline shuffles by index).
            disable_shuffling=True,
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        manual = Path(dl_manager.manual_dir)
        for required in ("train", "validation"):
            if not (manual / _SPLIT_FILES[required]).is_file():
                raise FileNotFoundError(
                    f"{manual / _SPLIT_FILES[required]} is missing.\n"
                    + self.MANUAL_DOWNLOAD_INSTRUCTIONS
                )
        tables = {
            split: parse_frappe_csv(manual / name)
            for split, name in _SPLIT_FILES.items()
            if (manual / name).is_file()
        }
        train = tables["train"]
        vocab = FrappeVocab(
            values=tuple(
                tuple(np.unique(train[:, 1 + f]).tolist()) for f in range(len(FRAPPE_FIELDS))
            )
        )
        mapped = {split: map_frappe_table(t, vocab) for split, t in tables.items()}
        self.info.metadata["vocab"] = {
            f: list(v) for f, v in zip(FRAPPE_FIELDS, vocab.values, strict=True)
        }
        self.info.metadata["oov"] = {split: m[2] for split, m in mapped.items()}
        return {
            split: self._generate_examples(ids_bf, labels_b)
            for split, (ids_bf, labels_b, _) in mapped.items()
        }

    def _generate_examples(self, ids_bf: np.ndarray, labels_b: np.ndarray):
        for i in range(labels_b.shape[0]):
            yield i, {"ids": ids_bf[i], "label": labels_b[i]}


def frappe_bars_vocab(builder: tfds.core.DatasetBuilder) -> FrappeVocab:
    """The train-file vocabulary saved in a prepared ``frappe_bars`` dataset's metadata."""
    vocab = builder.info.metadata["vocab"]
    return FrappeVocab(values=tuple(tuple(int(x) for x in vocab[f]) for f in FRAPPE_FIELDS))


def frappe_records_to_batch(records: Sequence[dict]) -> Batch:
    """Stacks ``frappe_bars`` records (as read from a data source) into a :class:`Batch`."""
    b = len(records)
    ids_bf = np.asarray([r["ids"] for r in records], np.int32).reshape(b, len(FRAPPE_FIELDS))
    return Batch(
        dense_bn=np.zeros((b, 0), np.float32),
        ids_bfh=ids_bf[:, :, None],
        labels_b=np.asarray([r["label"] for r in records], np.float32).reshape(b),
        weights_b=np.ones((b,), np.float32),
    )
