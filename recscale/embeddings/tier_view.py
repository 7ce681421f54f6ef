"""A tiered table's rows as of a checkpoint, read without changing its store.

A checkpoint of a tiered run (``recscale.embeddings.tiers``) holds the table's device cache;
the table itself is in its store, to which the trainer wrote every updated cached row back
before that checkpoint (``TieredTables.checkpoint``). The store's file moves on after it: a
row written after checkpoint ``k`` has its old bytes appended to ``undo.<k>.log`` (or a later
checkpoint's log) before its first overwrite. So the table as of checkpoint ``k`` is the file
with, for every row logged since ``k``, the value of its oldest record laid over it.
:class:`StoreView` reads it so and never writes the file or its logs: evaluating or exporting
a checkpoint of a tiered run (``relayout.restore_relaid``, which assembles the whole tables
from these views) neither disturbs a run still training on the store nor takes it back.

The logs are read again after every read of the file: a row the trainer writes meanwhile was
logged before it was written, so its value as of ``k`` is still found.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recscale.embeddings.tier_store import parse_records


def store_dir(embeddings, workdir: str | Path) -> Path:
    """Where a run's tier stores live: ``embeddings.tier_dir``, else ``WORKDIR/tiers``."""
    return Path(embeddings.tier_dir) if embeddings.tier_dir else Path(workdir) / "tiers"


class StoreView:
    """Rows ``[V, width]`` float32 (a row and its optimizer state) of the store in
    ``directory`` as they were at checkpoint ``step`` (module docstring)."""

    def __init__(self, directory: str | Path, num_rows: int, width: int, step: int):
        self.dir, self.num_rows, self.width, self.step = Path(directory), num_rows, width, step
        path = self.dir / "rows.f32"
        if not path.is_file() or path.stat().st_size != num_rows * width * 4:
            raise FileNotFoundError(
                f"tier store {path}: missing or not {num_rows} rows x {width} float32 (the "
                "run's embeddings.tier_dir moved, or another table size?)"
            )
        self._log(step)  # raises if checkpoint ``step`` cannot be recovered
        self._mm = np.memmap(path, np.float32, "r", shape=(num_rows, width))
        self._read_to: dict[int, int] = {}  # log step -> its bytes taken in
        self._rows = np.zeros(0, np.int64)  # every row logged since ``step``, sorted
        self._since = np.zeros(0, np.int64)  # the log of its value below
        self._vals = np.zeros((0, width), np.float32)  # its value at ``step``

    def _log(self, step: int) -> Path:
        path = self.dir / f"undo.{step}.log"
        if not path.is_file():
            have = sorted(int(p.name.split(".")[1]) for p in self.dir.glob("undo.*.log"))
            raise FileNotFoundError(
                f"tier store {self.dir}: no undo log for step {self.step} (logs: {have}); the "
                "store can give only the rows of a checkpoint the run still keeps"
            )
        return path

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as of the checkpoint, ``[stop - start, width]``."""
        out = np.array(self._mm[start:stop])
        self._take_logs()
        i, j = np.searchsorted(self._rows, [start, stop])
        out[self._rows[i:j] - start] = self._vals[i:j]
        return out

    def _take_logs(self) -> None:
        """Takes in the records appended to the logs of ``step`` and later since the last call
        (a torn last record is taken next time, when complete)."""
        parts = []
        for path in self.dir.glob("undo.*.log"):
            s = int(path.name.split(".")[1])
            if s < self.step:
                continue
            at = self._read_to.get(s, 0)
            with open(path, "rb") as f:
                f.seek(0, 2)
                if f.tell() < at:
                    raise RuntimeError(
                        f"tier store {self.dir}: {path.name} shrank while it was read (the "
                        "run went back to an earlier checkpoint); read it again"
                    )
                f.seek(at)
                data = f.read()
            for rows, old, end in parse_records(data, self.width):
                parts.append((np.full(len(rows), s, np.int64), rows, old))
                self._read_to[s] = at + end
        self._log(self.step)  # still there: its records are all taken in
        if not parts:
            return
        since = np.concatenate([self._since, *(p[0] for p in parts)])
        rows = np.concatenate([self._rows, *(p[1] for p in parts)])
        vals = np.concatenate([self._vals, *(p[2] for p in parts)])
        order = np.lexsort((since, rows))  # by row, its oldest log first
        rows, since, vals = rows[order], since[order], vals[order]
        first = np.ones(len(rows), bool)
        first[1:] = rows[1:] != rows[:-1]
        self._rows, self._since, self._vals = rows[first], since[first], vals[first]
