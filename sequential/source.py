"""The data source of a sequential run (``recscale.train.task``'s ``make_source``): packs of
whole histories, index-based, so a resumed run reads the batches a straight one does.

Shapes (dimension glossary): ``P`` packs per step (``data.batch_size``; this host's share),
``B`` histories per pack, ``T_pad`` token slots per pack, ``S`` sampled negatives, ``V`` items.

* Training step ``s`` is the packs ``s·P .. s·P + P - 1`` of the training ``Packer``'s stream
  (seeded epoch orders, one fixed shape), stacked: a ``JaggedBatch`` whose leaves have ``P``
  on their leading axis, which the trainer shards over the data-parallel devices.
* Evaluation reads the held-out users (or a seeded sample of ``data.eval_users``) once, in row order (``shuffle=False``), ``eval_batch_size``
  packs a step (the last step padded with empty packs), as :class:`EvalPacks`: the packs and
  each history's sampled negatives (``data.sampled_negatives``; None without them).

Planted data: the held-out users' whole histories, each token predicting the next one (the
context is the history but its last item, whose target is that item), so the model's eval
loss is over the positions ``t >= 1`` that ``PlantedSequences.losses`` scores; its
``bayes`` (and ``taste_known``) loss is in every evaluation and in ``data_stats.json`` with the
baselines'. SASRec files and event logs of a sequence spec (``data.tabular.seq_prepare``,
prepared on first use): only the held-out item is a target (``targets="final"``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from data.pipeline import host_batch_size
from data.sequences import (
    Histories,
    JaggedBatch,
    PackConfig,
    Packer,
    PlantedSequences,
    leave_one_out,
    read_sasrec,
)
from data.sequences.histories import last_per_user
from recscale.config import ConfigError
from sequential.metrics import sasrec_negatives


@dataclasses.dataclass(frozen=True)
class SequenceSchema:
    """What a sequential model is built for (the trainer's ``schema``)."""

    n_items: int
    """V: item ids ``1..V``."""
    max_seq_len: int
    """N: histories are cut to their most recent N events."""


class EvalPacks(NamedTuple):
    """One evaluation step's data: ``pack`` (leaves ``[P, ...]``) and ``negatives`` int32
    ``[P, B, S]`` (None: no sampled protocol)."""

    pack: JaggedBatch
    negatives: np.ndarray | None


class SequenceReads:
    """Histories handed out by split (``data.sources.ReadCounts``'s ``as_dict``); padding
    histories are not counted."""

    def __init__(self, rows_held: int):
        self.rows_held = rows_held
        self._counts = {"train": 0, "eval": 0}
        self._lock = threading.Lock()

    def add(self, split: str, pack: JaggedBatch) -> None:
        with self._lock:
            self._counts[split] += int((pack.weights > 0).sum())

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "rows_held": self.rows_held}


def recent(hist: Histories, n: int) -> Histories:
    """``hist`` with every history cut to its most recent ``n`` events."""
    lengths = hist.lengths()
    if lengths.size == 0 or lengths.max() <= n:
        return hist
    return hist.take(last_per_user(lengths, n))


def stack(packs: list[JaggedBatch]) -> JaggedBatch:
    """Packs stacked on a new leading axis."""
    fields = {f: np.stack([getattr(p, f) for p in packs]) for f in JaggedBatch._fields[:-1]}
    side = {k: np.stack([p.side[k] for p in packs]) for k in packs[0].side}
    return JaggedBatch(**fields, side=side)


def _planted(d: Any, eval_only: bool) -> dict[str, Any]:
    if d.planted.min_len < 2:
        raise ConfigError(
            f"data.planted.min_len={d.planted.min_len}: held-out histories need >= 2 events "
            "(a context and its held-out item)"
        )
    gen = PlantedSequences(d.planted, seed=d.shuffle_seed)
    train = gen.train_histories(0, d.num_train_users)
    full = gen.eval_histories()
    losses = gen.losses(full, train)
    return {
        "train": None if eval_only else train,
        "context": full.take(~last_per_user(full.lengths(), 1)),
        "final": full.items[full.offsets[1:] - 1],
        "rated": full,
        "targets": "next",
        "stats": {"planted_losses": losses},
        "reference": {"bayes_loss": losses["bayes"], "taste_known_loss": losses["taste_known"]},
    }


def _sasrec(d: Any, eval_only: bool) -> dict[str, Any]:
    path = d.sasrec_path
    if not path:
        raise ConfigError("data.kind=sasrec needs data.sasrec_path (a SASRec user-item file)")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"data.sasrec_path={path}: no such file (SASRec's data/Video.txt is in "
            "github:kang205/SASRec; pass its path with --data.sasrec-path)"
        )
    split = leave_one_out(read_sasrec(path))
    rows = split.eval_rows()
    valid = d.eval_split == "valid"
    context = split.train if valid else split.test_context
    final = (split.valid_targets if valid else split.test_targets)[rows]
    return {
        "train": None if eval_only else split.train,
        "context": context.select(rows),
        "final": final,
        "rated": split.train.select(rows),  # SASRec's evaluate: rated = set(train[u])
        "targets": "final",
        "stats": {"sasrec_path": path, "users_short": split.users_short},
        "reference": {},
    }


def _tabular(d: Any, eval_only: bool) -> dict[str, Any]:
    from data.tabular.seq_prepare import prepare_sequences, split_histories  # pyarrow

    prepared = prepare_sequences(d.tabular.spec, d.tabular.prepared_dir)
    split = split_histories(prepared.spec, prepared.hist)
    if d.eval_split not in split.held_out:
        raise ConfigError(
            f"data.eval_split={d.eval_split!r}: the spec {d.tabular.spec} holds out no "
            f"{d.eval_split} item (split kind time without test_from); set "
            "--data.eval-split valid or give the split a test_from"
        )
    context, final = split.held_out[d.eval_split]
    return {
        "train": None if eval_only else split.train,
        "context": context,
        "final": final,
        "rated": context,  # the user's items before the target: excluded from negatives
        "targets": "final",
        "stats": {"prepared": prepared.folder, "preparation": prepared.stats, **split.stats},
        "reference": {},
    }


_KINDS = {"planted": _planted, "sasrec": _sasrec, "tabular": _tabular}


class SequenceSource:
    """The packs of a ``SequentialConfig`` run (module docstring)."""

    def __init__(
        self, cfg: Any, *, process_index: int = 0, process_count: int = 1, eval_only: bool = False
    ):
        d, n = cfg.data, cfg.model.max_seq_len
        self.per_host = host_batch_size(d.batch_size, process_count)
        self.eval_per_host = host_batch_size(d.eval_batch_size, process_count)
        self.packs, self.eval_packs = d.batch_size, d.eval_batch_size
        self.process_index = process_index
        parts = _KINDS[d.kind](d, eval_only)
        if d.eval_users and d.eval_users < parts["context"].num_users:
            rng = np.random.default_rng(d.shuffle_seed)
            keep = np.sort(rng.choice(parts["context"].num_users, d.eval_users, replace=False))
            for k in ("context", "rated"):
                parts[k] = parts[k].select(keep)
            parts["final"] = parts["final"][keep]
        context = recent(parts["context"], n)
        if context.n_items != cfg.model.n_items:
            raise ConfigError(
                f"model.n_items={cfg.model.n_items} but the data has {context.n_items} items: "
                f"set --model.n-items {context.n_items}"
            )
        self.schema = SequenceSchema(n_items=context.n_items, max_seq_len=n)
        pack = PackConfig(
            token_budget=d.token_budget,
            max_sequences=d.max_sequences,
            block_size=d.block_size,
            pad_tokens="budget",
        )
        self.train_packer = None
        self.stats: dict[str, Any] = {"kind": d.kind, **parts["stats"]}
        if parts["train"] is not None:
            train = recent(parts["train"], n)
            self.train_packer = Packer(train, pack, seed=d.shuffle_seed)
            lengths = train.lengths().astype(np.float64)
            self.stats.update(
                train_users=train.num_users,
                train_tokens=int(lengths.sum()),
                train_packs_per_epoch=self.train_packer.num_batches(0),
                truncated_users=self.train_packer.truncated_users,
            )
            counts = np.bincount(train.items, minlength=context.n_items + 1).astype(np.float64)
            counts[0] = 0.0
            with np.errstate(divide="ignore"):
                self._log_q = np.log(counts / counts.sum()).astype(np.float32)
        self.eval_packer = Packer(
            context,
            dataclasses.replace(pack, shuffle=False),
            final_targets=parts["final"],
            targets=parts["targets"],
        )
        self.stats.update(eval_users=context.num_users)
        self.reference = parts["reference"]
        self._rated, self._final = parts["rated"], parts["final"]
        self._num_negatives, self._seed = d.sampled_negatives, d.shuffle_seed
        self._negatives: np.ndarray | None = None
        self.reads = SequenceReads(rows_held=context.num_users + self.stats.get("train_users", 0))

    @property
    def num_eval_examples(self) -> int:
        """Held-out users."""
        return self.eval_packer.hist.num_users

    def item_log_q(self) -> np.ndarray:
        """float32 [V + 1]: ``log q`` of the training items' frequencies (``-inf`` at row 0 and
        at items never trained on): the popularity sampler's distribution."""
        if self.train_packer is None:
            raise RuntimeError("this source was built eval-only (no training histories)")
        return self._log_q

    def train_batch(self, step: int) -> JaggedBatch:
        """This host's packs of training step ``step``."""
        if self.train_packer is None:
            raise RuntimeError("this source was built eval-only (no training histories)")
        first = step * self.packs + self.process_index * self.per_host
        batch = stack([self.train_packer.batch(first + j) for j in range(self.per_host)])
        self.reads.add("train", batch)
        return batch

    def _eval_negatives(self, pack: JaggedBatch) -> np.ndarray:
        if self._negatives is None:  # a pure function of (seed, row): drawn once, kept
            rows = np.arange(self._rated.num_users)
            self._negatives = sasrec_negatives(
                self._rated, rows, self._final, seed=self._seed, num=self._num_negatives
            )
        rows = pack.user_rows
        return np.where(rows[:, None] >= 0, self._negatives[np.maximum(rows, 0)], 0)

    def eval_batches(self) -> Iterator[EvalPacks]:
        """The held-out users once (module docstring)."""
        n = self.eval_packer.num_batches(0)
        empty = self.eval_packer.pack_rows(np.zeros(0, np.int64))
        for start in range(0, n, self.eval_packs):
            first = start + self.process_index * self.eval_per_host
            packs = [
                self.eval_packer.batch_at(0, k) if k < n else empty
                for k in range(first, first + self.eval_per_host)
            ]
            negatives = None
            if self._num_negatives:
                negatives = np.stack([self._eval_negatives(p) for p in packs]).astype(np.int32)
            batch = stack(packs)
            self.reads.add("eval", batch)
            yield EvalPacks(batch, negatives)
