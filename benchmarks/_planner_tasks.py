"""Sharding tasks in NeuroShard's style, shared by ``cost_table.py`` and ``planner_quality.py``.

A task is a set of 10-60 tables (rows, width, pooling factor, Zipf skew), a device count (4 or
8), a global batch and a memory cap per device. Its tables are drawn from three pools:

* ``criteo``: the 26 Criteo Kaggle cardinalities (``data.config.CRITEO_KAGGLE_VOCAB_SIZES``,
  as facebookresearch/dlrm and TorchRec use them), one id per example;
* ``mlperf``: the 26 Criteo Terabyte tables capped at 40M rows
  (``CRITEO_TERABYTE_VOCAB_SIZES``) with MLPerf DLRM-DCNv2's multi-hot sizes (3, 2, 1, 2, 6, 1,
  1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1: TorchRec's
  ``examples/golden_training`` / MLPerf training v3 reference ``--multi_hot_sizes``);
* ``dlrm-datasets``: synthetic tables shaped after Meta's ``dlrm_datasets`` (embedding_bag
  2021/2022) as NeuroShard describes them: hash sizes log-uniform 10^3-10^7, pooling factors
  log-normal (median 8, heavy tail, at most 200), skew spread from uniform to strong. Drawn
  from these summary shapes, not from the dataset's files (not reachable from here).

Widths are drawn from {16, 32, 64, 128} per table. Skew: a ``skewed`` task's tables take
Zipf exponents in [0.8, 1.2] (Criteo's categorical ids are power-law distributed; the study's
data presets use 1.1); a ``uniform`` task's tables 0. Rows are scaled by ``1/ROW_SCALE`` (at
least 64) so a task's devices can be timed on this 24 GiB, 32 MiB-L3 CPU: a scaled 1M-row table
is still 8-30x the last-level cache, so misses still cost as they do at full size.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from data.config import CRITEO_KAGGLE_VOCAB_SIZES, CRITEO_TERABYTE_VOCAB_SIZES

ROW_SCALE = 40
MLPERF_HOTNESS = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
WIDTHS = (16, 32, 64, 128)
POOLS = ("criteo", "mlperf", "dlrm-datasets")


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    rows: int
    dim: int
    hotness: int
    zipf: float


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    tables: tuple[Table, ...]
    devices: int
    batch: int
    memory_cap: float
    """Bytes of tables and optimizer state a device may hold."""
    skewed: bool

    @property
    def pad_hotness(self) -> int:
        """The engine pads every bag to the model's widest (``ids_bfh``'s H)."""
        return max(t.hotness for t in self.tables)


def _scaled(rows: int) -> int:
    return max(64, rows // ROW_SCALE)


def draw_table(rng: np.random.Generator, pool: str, i: int, skewed: bool) -> Table:
    dim = int(rng.choice(WIDTHS))
    zipf = float(rng.uniform(0.8, 1.2)) if skewed else 0.0
    if pool == "criteo":
        j = int(rng.integers(len(CRITEO_KAGGLE_VOCAB_SIZES)))
        return Table(f"criteo{j}_{i}", _scaled(CRITEO_KAGGLE_VOCAB_SIZES[j]), dim, 1, zipf)
    if pool == "mlperf":
        j = int(rng.integers(len(CRITEO_TERABYTE_VOCAB_SIZES)))
        rows, hot = _scaled(CRITEO_TERABYTE_VOCAB_SIZES[j]), MLPERF_HOTNESS[j]
        return Table(f"mlperf{j}_{i}", rows, dim, hot, zipf)
    rows = _scaled(int(10 ** rng.uniform(3, 7)))
    hot = int(np.clip(np.round(rng.lognormal(np.log(8), 1.0)), 1, 200))
    return Table(f"dd{i}", rows, dim, hot, zipf)


def draw_task(
    rng: np.random.Generator,
    name: str,
    *,
    num_tables: int,
    devices: int,
    skewed: bool,
    batch: int = 4096,
    pools: tuple[str, ...] = POOLS,
    max_hotness: int = 32,
) -> Task:
    """A task: ``num_tables`` tables from ``pools`` (bags capped at ``max_hotness`` ids, so
    one 100-id table does not pad every bag of the task to 100), memory cap 1.3x a balanced
    share, and at least 0.6x the largest table (so big tables must be split)."""
    tables = []
    for i in range(num_tables):
        t = draw_table(rng, str(rng.choice(pools)), i, skewed)
        tables.append(dataclasses.replace(t, hotness=min(t.hotness, max_hotness)))
    sizes = [t.rows * (t.dim * 4 + 4) for t in tables]
    cap = max(1.3 * sum(sizes) / devices, 0.6 * max(sizes))
    return Task(name, tuple(tables), devices, batch, cap, skewed)
