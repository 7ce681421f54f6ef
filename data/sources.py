"""Data sources: what the training loop asks for (a batch per step, the eval set once).

Every source is index-based: ``train_batch(step)`` is a pure function of ``step`` (this host's
part of global batch ``step``), so resuming from a checkpoint at step ``k`` continues exactly.
:func:`data.builders.make_source` builds the source a :class:`~data.config.DataConfig` describes: raw Frappe
and Criteo files parsed into an :class:`InMemorySource` by default, or, with
``DataConfig.tfds_data_dir``, a prepared tfds array_record dataset read by random access through
a :class:`RandomAccessSource` (same batches for the same files and settings).

Every source passes its rows through one :class:`~data.id_guard.IdGuard` (policy
``DataConfig.id_policy``) before it hands out a batch: in-memory rows once when they are loaded,
records read from disk and generated examples batch by batch. So no batch leaves a source with a
sparse id outside ``[0, vocab_size)`` (other than the pad id): it was rejected with an error
naming the feature, value and record, or mapped into range and counted in ``stats["ids"]``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from data.batch import Batch, Schema
from data.config import DataConfig
from data.id_guard import IdGuard, IdPolicy
from data.pipeline import (
    eval_index_batches,
    gather,
    host_batch_size,
    pad_weights,
    train_dataset,
)
from data.schemas import capped


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

    reads: ReadCounts
    """Examples this process has read or generated (each host reads only its share)."""


class ReadCounts:
    """Examples a source handed out on this process, by split (``train``, ``eval``: padding
    examples of the last eval batch included), and rows it holds in memory (an in-memory source
    loads whole files on every process; random-access and synthetic sources hold none).
    Thread-safe: the trainer may draw batches on two threads."""

    def __init__(self, rows_held: int = 0):
        self.rows_held = rows_held
        self._counts = {"train": 0, "eval": 0}
        self._lock = threading.Lock()

    def add(self, split: str, batch: Batch) -> Batch:
        with self._lock:
            self._counts[split] += int(batch.labels_b.shape[0])
        return batch

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "rows_held": self.rows_held}


class _IndexedSource:
    """What the file-backed sources share: training batches drawn through a shuffled index
    dataset (``data.pipeline.train_dataset``), the eval set read in order and padded with
    weight-0 examples. A subclass holds its rows (``_hold``) and reads them by index
    (``_read``)."""

    def __init__(
        self,
        schema: Schema,
        train_rows: Any,
        eval_rows: Any,
        *,
        batch_size: int,
        eval_batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        stats: dict[str, Any] | None = None,
        id_policy: IdPolicy = "reject",
    ):
        """Args: the schema, training and eval rows (as the subclass takes them); global batch
        sizes; ``stats`` are reader counters exposed for logging; ``id_policy``: what the id
        guard does with an id outside its vocabulary.

        Raises:
          ValueError: rows that break ``schema`` (or hold a bad id under ``reject``), no
            training rows, or batch sizes not divisible by ``process_count``.
        """
        self.schema = schema
        self._guard = IdGuard(schema, id_policy)
        num_train, rows_held = self._hold(train_rows, eval_rows)
        host_batch_size(eval_batch_size, process_count)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.process_index = process_index
        self.process_count = process_count
        self.stats: dict[str, Any] = {**(stats or {}), "ids": self._guard.stats}
        self.reads = ReadCounts(rows_held=rows_held)
        self.train_indices = None
        """grain MapDataset: step -> this host's example indices (see ``data.pipeline``);
        None for an eval-only source (no training rows)."""
        if num_train is not None:
            self.train_indices = train_dataset(
                num_train,
                batch_size=batch_size,
                seed=seed,
                process_index=process_index,
                process_count=process_count,
            )

    def _hold(self, train_rows: Any, eval_rows: Any) -> tuple[int | None, int]:
        """Keeps the rows (guarding those held in memory); returns the number of training
        examples (None: eval-only) and the rows held in memory."""
        raise NotImplementedError

    def _read(self, split: str, indices: np.ndarray) -> Batch:
        """The examples at ``indices`` of ``split`` (``train`` or ``eval``), guarded."""
        raise NotImplementedError

    @property
    def num_eval_examples(self) -> int:
        raise NotImplementedError

    def train_batch(self, step: int) -> Batch:
        if self.train_indices is None:
            raise RuntimeError("this source was built eval-only (no training rows were read)")
        return self.reads.add("train", self._read("train", self.train_indices[step]))

    def eval_batches(self) -> Iterator[Batch]:
        for indices, num_valid in eval_index_batches(
            self.num_eval_examples,
            batch_size=self.eval_batch_size,
            process_index=self.process_index,
            process_count=self.process_count,
        ):
            yield self.reads.add("eval", pad_weights(self._read("eval", indices), num_valid))


class InMemorySource(_IndexedSource):
    """A :class:`DataSource` over datasets held as one :class:`Batch` of all rows each:
    ``InMemorySource(schema, train_rows, eval_rows, batch_size=..., eval_batch_size=...,
    seed=...)``; ``train_rows=None`` builds an eval-only source."""

    def _hold(self, train_rows: Batch | None, eval_rows: Batch) -> tuple[int | None, int]:
        # All rows are guarded once, here: counts are per row held, not per time it is drawn.
        if train_rows is not None:
            train_rows = self._guard(train_rows, where="training rows")
        self.train_rows = train_rows
        self.eval_rows = self._guard(eval_rows, where="eval rows")
        num_train = None if train_rows is None else train_rows.batch_size
        return num_train, self.eval_rows.batch_size + (num_train or 0)

    @property
    def num_train_examples(self) -> int:
        return self.train_rows.batch_size

    @property
    def num_eval_examples(self) -> int:
        return self.eval_rows.batch_size

    def _read(self, split: str, indices: np.ndarray) -> Batch:
        return gather(self.train_rows if split == "train" else self.eval_rows, indices)


class RandomAccessSource(_IndexedSource):
    """A :class:`DataSource` over random-access record sources, e.g. tfds data sources.

    ``train_records`` and ``eval_records`` support ``len()`` and ``__getitem__`` (``__getitems__`` is used when
    present, as on ``tfds`` array_record data sources); ``to_batch`` stacks a list of records into
    a :class:`Batch` (e.g. ``data.tfds_builders.frappe.frappe_records_to_batch``).
    ``eval_records`` may instead be a :class:`Batch` of all eval rows held in memory (an eval
    file that is not part of the prepared dataset); it is guarded once, here. Records are
    guarded batch by batch as they are read (``id_policy``, see ``data.id_guard``). The other
    arguments are :class:`InMemorySource`'s.
    """

    def __init__(
        self,
        schema: Schema,
        train_records: Sequence[Any],
        eval_records: Sequence[Any] | Batch,
        *,
        to_batch: Callable[[Sequence[Any]], Batch],
        **kw: Any,
    ):
        self._to_batch = to_batch
        super().__init__(schema, train_records, eval_records, **kw)

    def _hold(self, train_rows: Sequence[Any], eval_rows: Any) -> tuple[int | None, int]:
        if isinstance(eval_rows, Batch):
            eval_rows = self._guard(eval_rows, where="eval rows")
        self._train, self._eval = train_rows, eval_rows
        return len(train_rows), eval_rows.batch_size if isinstance(eval_rows, Batch) else 0

    @property
    def num_train_examples(self) -> int:
        return len(self._train)

    @property
    def num_eval_examples(self) -> int:
        return self._eval.batch_size if isinstance(self._eval, Batch) else len(self._eval)

    def _read(self, split: str, indices: np.ndarray) -> Batch:
        records = self._train if split == "train" else self._eval
        if isinstance(records, Batch):
            return gather(records, indices)  # guarded whole in __init__
        keys = indices.tolist()
        getitems = getattr(records, "__getitems__", None)
        recs = getitems(keys) if getitems is not None else [records[k] for k in keys]
        # Records come from disk: an out-of-range id would silently read a padding row (or NaN)
        # inside jit, so every batch is guarded and an offending record is named.
        return self._guard(self._to_batch(recs), where=f"{split} records", example_ids=indices)


class SyntheticSource:
    """A :class:`DataSource` over :class:`data.synthetic.SyntheticGenerator` (stateless)."""

    parallel_batches = True
    """``train_batch`` is a pure function of the step: the trainer may call it on two threads."""

    def __init__(self, cfg: DataConfig, *, process_index: int = 0, process_count: int = 1):
        host_batch_size(cfg.batch_size, process_count)
        host_batch_size(cfg.eval_batch_size, process_count)
        self._gen = _synthetic_generator(cfg.synthetic, cfg.shuffle_seed)
        # With data.max_table_rows the model sees capped tables; the guard folds the ids.
        self.schema: Schema = capped(self._gen.schema, cfg.max_table_rows)
        self._cfg = cfg
        # The generator only draws valid ids; the guard makes that a checked fact, as for files.
        self._guard = IdGuard(self.schema, cfg.id_policy)
        self.process_index = process_index
        self.process_count = process_count
        self.stats: dict[str, Any] = {
            "kind": "synthetic",
            "num_eval_examples": cfg.synthetic.num_eval_examples,
            "ids": self._guard.stats,
        }
        self.reads = ReadCounts()

    @property
    def num_eval_examples(self) -> int:
        return self._cfg.synthetic.num_eval_examples

    def train_batch(self, step: int) -> Batch:
        batch = self._gen.train_batch(
            step,
            self._cfg.batch_size,
            process_index=self.process_index,
            process_count=self.process_count,
        )
        return self.reads.add("train", self._guard(batch, where=f"synthetic train step {step}"))

    def eval_batches(self) -> Iterator[Batch]:
        key = (
            self._cfg.synthetic,
            self._cfg.shuffle_seed,
            self._cfg.eval_batch_size,
            self.process_index,
            self.process_count,
        )
        with _EVAL_CACHE_LOCK:
            cached = _EVAL_CACHE.get(key)
        if cached is None:
            batches = self._gen.eval_batches(
                self._cfg.eval_batch_size,
                process_index=self.process_index,
                process_count=self.process_count,
            )
            cached = []
            for batch in batches:
                for a in batch:
                    a.setflags(write=False)
                cached.append(batch)
                yield self.reads.add(
                    "eval", self._guard(batch, where=f"synthetic eval batch {len(cached) - 1}")
                )
            nbytes = sum(a.nbytes for b in cached for a in b)
            if nbytes <= _EVAL_CACHE_MAX_BYTES:
                with _EVAL_CACHE_LOCK:
                    _EVAL_CACHE.clear()
                    _EVAL_CACHE[key] = cached
            return
        for j, batch in enumerate(cached):
            yield self.reads.add("eval", self._guard(batch, where=f"synthetic eval batch {j}"))


# The held-out set is a pure function of the generator's config and seed, and every evaluation
# of every run on one config reads all of it: a process (a sweep's trial server runs many trials)
# keeps the last config's generator and eval batches instead of generating them again (batches
# are read-only numpy arrays; the id guard still checks and counts every batch it yields).
_EVAL_CACHE: dict[tuple, list[Batch]] = {}
_EVAL_CACHE_LOCK = threading.Lock()
_EVAL_CACHE_MAX_BYTES = 512 << 20


@functools.lru_cache(maxsize=2)
def _synthetic_generator(cfg, seed: int):
    from data.synthetic import SyntheticGenerator

    return SyntheticGenerator(cfg, seed=seed)
