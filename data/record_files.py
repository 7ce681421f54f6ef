"""Records of array_record files read by random access: the prepared tabular datasets' shards
(``data.tabular.prepare``) and tfds' prepared splits (``data.builders``) share this reader."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np


class ArrayRecordFiles:
    """Records ``[skip, skip + take)`` of each of several array_record files, in order, as one
    random-access sequence (``len``, ``[]``, ``__getitems__``: a grain data source).

    One ``ArrayRecordReader.read`` per file and batch: grain's and tfds' array_record sources
    sort keys per file and re-order results in Python, which made batch reads about 2x slower
    (tfds ~5 ms per call; ``benchmarks/tabular_prepare.py`` measured grain's too).
    """

    def __init__(
        self, files: Sequence[str], takes: Sequence[int], skips: Sequence[int] | None = None
    ):
        self._files = [os.fspath(f) for f in files]
        self._readers: list[Any] = [None] * len(self._files)  # opened on first use
        self._open: list[int] = []  # open readers, oldest first (at most MAX_OPEN)
        self._lock = threading.Lock()
        takes = np.asarray(takes, np.int64)
        skips = np.zeros_like(takes) if skips is None else np.asarray(skips, np.int64)
        self._ends = np.cumsum(takes)
        self._first = skips - (self._ends - takes)
        self._len = int(self._ends[-1]) if takes.size else 0

    def __len__(self) -> int:
        return self._len

    MAX_OPEN = 256
    """Open readers at most (a file descriptor each): Criteo Terabyte's prepared shards number
    in the thousands, past a common open-file limit of 1,024."""

    def __getstate__(self):  # readers are reopened where the sequence is unpickled
        return {**self.__dict__, "_readers": [None] * len(self._files), "_open": [], "_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _reader(self, shard: int):
        from array_record.python.array_record_module import ArrayRecordReader

        with self._lock:
            reader = self._readers[shard]
            if reader is None:
                # readahead 0: random access, as the array_record data source opens its readers.
                reader = ArrayRecordReader(self._files[shard], "readahead_buffer_size:0")
                self._readers[shard] = reader
                self._open.append(shard)
                if len(self._open) > self.MAX_OPEN:
                    # Dropped, not closed: a thread reading it keeps it until it is done.
                    self._readers[self._open.pop(0)] = None
            return reader

    def __getitem__(self, key: int) -> bytes:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[int]) -> list[bytes]:
        keys_b = np.asarray(keys, np.int64)
        if keys_b.size and (keys_b.min() < 0 or keys_b.max() >= self._len):
            raise IndexError(f"record keys must be in [0, {self._len})")
        shard = np.searchsorted(self._ends, keys_b, side="right")
        pos = keys_b + self._first[shard]  # position within the shard's file
        if len(self._files) == 1:
            return self._reader(0).read(pos.tolist())
        out: list[bytes] = [b""] * keys_b.size
        for s in np.unique(shard).tolist():
            sel = np.flatnonzero(shard == s)
            records = self._reader(s).read(pos[sel].tolist())
            for i, record in zip(sel.tolist(), records, strict=True):
                out[i] = record
        return out
