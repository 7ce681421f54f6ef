"""Data sources: what the training loop asks for (a batch per step, the eval set once).

Every source is index-based: ``train_batch(step)`` is a pure function of ``step`` (this host's
part of global batch ``step``), so resuming from a checkpoint at step ``k`` continues exactly.
:func:`make_source` builds the source a :class:`~data.config.DataConfig` describes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from data.batch import Batch, Schema
from data.config import DataConfig
from data.pipeline import (
    eval_index_batches,
    gather,
    host_batch_size,
    pad_weights,
    train_dataset,
)


@runtime_checkable
class DataSource(Protocol):
    """What the training and evaluation loops consume."""

    schema: Schema

    def train_batch(self, step: int) -> Batch:
        """This host's part of global training batch ``step`` (a pure function of ``step``)."""
        ...

    def eval_batches(self) -> Iterator[Batch]:
        """The whole eval set once, in fixed-size batches; padding examples have weight 0."""
        ...

    @property
    def num_eval_examples(self) -> int:
        """Real (unpadded) examples in the eval set, over all hosts."""
        ...


class InMemorySource:
    """A :class:`DataSource` over datasets held as one :class:`Batch` of all rows each."""

    def __init__(
        self,
        schema: Schema,
        train_rows: Batch,
        eval_rows: Batch,
        *,
        batch_size: int,
        eval_batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        stats: dict[str, Any] | None = None,
    ):
        """Args: global batch sizes; ``stats`` are reader counters exposed for logging.

        Raises:
          ValueError: rows that break ``schema``, no training rows, or batch sizes not divisible
            by ``process_count``.
        """
        schema.validate(train_rows, where="training rows")
        schema.validate(eval_rows, where="eval rows")
        host_batch_size(eval_batch_size, process_count)
        self.schema = schema
        self.train_rows = train_rows
        self.eval_rows = eval_rows
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.process_index = process_index
        self.process_count = process_count
        self.stats: dict[str, Any] = dict(stats or {})
        self.train_indices = train_dataset(
            train_rows.batch_size,
            batch_size=batch_size,
            seed=seed,
            process_index=process_index,
            process_count=process_count,
        )
        """grain MapDataset: step -> this host's example indices (see ``data.pipeline``)."""

    @property
    def num_train_examples(self) -> int:
        return self.train_rows.batch_size

    @property
    def num_eval_examples(self) -> int:
        return self.eval_rows.batch_size

    def train_batch(self, step: int) -> Batch:
        return gather(self.train_rows, self.train_indices[step])

    def eval_batches(self) -> Iterator[Batch]:
        for indices, num_valid in eval_index_batches(
            self.num_eval_examples,
            batch_size=self.eval_batch_size,
            process_index=self.process_index,
            process_count=self.process_count,
        ):
            yield pad_weights(gather(self.eval_rows, indices), num_valid)


class RandomAccessSource:
    """A :class:`DataSource` over random-access record sources, e.g. tfds data sources.

    ``train_records`` and ``eval_records`` support ``len()`` and ``__getitem__`` (``__getitems__`` is used when
    present, as on ``tfds`` array_record data sources); ``to_batch`` stacks a list of records into
    a :class:`Batch` (e.g. ``data.tfds_builders.frappe.frappe_records_to_batch``).
    """

    def __init__(
        self,
        schema: Schema,
        train_records: Sequence[Any],
        eval_records: Sequence[Any],
        *,
        to_batch: Callable[[Sequence[Any]], Batch],
        batch_size: int,
        eval_batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        stats: dict[str, Any] | None = None,
    ):
        host_batch_size(eval_batch_size, process_count)
        self.schema = schema
        self._train, self._eval, self._to_batch = train_records, eval_records, to_batch
        self.eval_batch_size = eval_batch_size
        self.process_index = process_index
        self.process_count = process_count
        self.stats: dict[str, Any] = dict(stats or {})
        self.train_indices = train_dataset(
            len(train_records),
            batch_size=batch_size,
            seed=seed,
            process_index=process_index,
            process_count=process_count,
        )

    @property
    def num_eval_examples(self) -> int:
        return len(self._eval)

    def _fetch(self, records: Sequence[Any], indices: np.ndarray) -> Batch:
        keys = indices.tolist()
        getitems = getattr(records, "__getitems__", None)
        recs = getitems(keys) if getitems is not None else [records[k] for k in keys]
        return self._to_batch(recs)

    def train_batch(self, step: int) -> Batch:
        return self._fetch(self._train, self.train_indices[step])

    def eval_batches(self) -> Iterator[Batch]:
        for indices, num_valid in eval_index_batches(
            self.num_eval_examples,
            batch_size=self.eval_batch_size,
            process_index=self.process_index,
            process_count=self.process_count,
        ):
            yield pad_weights(self._fetch(self._eval, indices), num_valid)


class SyntheticSource:
    """A :class:`DataSource` over :class:`data.synthetic.SyntheticGenerator` (stateless)."""

    def __init__(self, cfg: DataConfig, *, process_index: int = 0, process_count: int = 1):
        from data.synthetic import SyntheticGenerator

        host_batch_size(cfg.batch_size, process_count)
        host_batch_size(cfg.eval_batch_size, process_count)
        self._gen = SyntheticGenerator(cfg.synthetic, seed=cfg.shuffle_seed)
        self.schema: Schema = self._gen.schema
        self._cfg = cfg
        self.process_index = process_index
        self.process_count = process_count
        self.stats: dict[str, Any] = {
            "kind": "synthetic",
            "num_eval_examples": cfg.synthetic.num_eval_examples,
        }

    @property
    def num_eval_examples(self) -> int:
        return self._cfg.synthetic.num_eval_examples

    def train_batch(self, step: int) -> Batch:
        return self._gen.train_batch(
            step,
            self._cfg.batch_size,
            process_index=self.process_index,
            process_count=self.process_count,
        )

    def eval_batches(self) -> Iterator[Batch]:
        return self._gen.eval_batches(
            self._cfg.eval_batch_size,
            process_index=self.process_index,
            process_count=self.process_count,
        )


def _eval_path(cfg: DataConfig, eval_path: str | None) -> str:
    path = eval_path or cfg.eval_path
    if not path:
        raise ValueError(f"data.kind={cfg.kind!r} needs an eval file: set data.eval_path")
    return path


def _make_frappe(cfg: DataConfig, eval_path: str, **kw) -> InMemorySource:
    from data.frappe.reader import build_frappe_vocab, frappe_schema, read_frappe

    vocab = build_frappe_vocab(cfg.train_path)
    train_rows, train_stats = read_frappe(cfg.train_path, vocab)
    eval_rows, eval_stats = read_frappe(eval_path, vocab)
    stats = {
        "kind": "frappe",
        "vocab_sizes": list(vocab.vocab_sizes),
        "train": train_stats.as_dict(),
        "eval": eval_stats.as_dict(),
    }
    return InMemorySource(frappe_schema(vocab), train_rows, eval_rows, stats=stats, **kw)


def _make_criteo(cfg: DataConfig, eval_path: str, rejects_dir: str | None, **kw) -> InMemorySource:
    from data.criteo.reader import criteo_schema, read_criteo

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
    train_rows, train_stats = read_criteo(cfg.train_path, cfg.criteo, rejects_path=rejects)
    eval_rows, eval_stats = read_criteo(eval_path, cfg.criteo, rejects_path=eval_rejects)
    stats = {
        "kind": "criteo",
        "train": dataclasses.asdict(train_stats),
        "eval": dataclasses.asdict(eval_stats),
        "report": f"train {train_stats.report()}; eval {eval_stats.report()}",
    }
    return InMemorySource(
        criteo_schema(cfg.criteo.vocab_sizes), train_rows, eval_rows, stats=stats, **kw
    )


def make_source(
    cfg: DataConfig,
    *,
    process_index: int = 0,
    process_count: int = 1,
    eval_path: str | None = None,
    rejects_dir: str | None = None,
) -> DataSource:
    """Builds the data source ``cfg`` describes, for host ``process_index`` of ``process_count``.

    Args:
      cfg: dataset kind, files, global batch sizes and shuffle seed.
      eval_path: overrides ``cfg.eval_path`` (e.g. a test file).
      rejects_dir: lenient Criteo reading writes rejected rows to
        ``<rejects_dir>/criteo_rejects.tsv`` (train) and ``criteo_rejects.eval.tsv`` (eval)
        unless ``cfg.criteo.rejects_path`` is set (then the eval file is its ``.eval`` sibling).

    Returns:
      A :class:`DataSource`; its ``stats`` dict holds the readers' counters for logging.
    """
    if cfg.kind == "synthetic":
        return SyntheticSource(cfg, process_index=process_index, process_count=process_count)
    kw = dict(
        batch_size=cfg.batch_size,
        eval_batch_size=cfg.eval_batch_size,
        seed=cfg.shuffle_seed,
        process_index=process_index,
        process_count=process_count,
    )
    if cfg.kind == "frappe":
        return _make_frappe(cfg, _eval_path(cfg, eval_path), **kw)
    if cfg.kind == "criteo":
        return _make_criteo(cfg, _eval_path(cfg, eval_path), rejects_dir, **kw)
    raise ValueError(f"unknown data.kind {cfg.kind!r}; expected synthetic, frappe or criteo")
