"""Load and run an exported next-item model (HSTU, SASRec) with only jax and flatbuffers.

Copied into every artifact as ``recscale_next_item.py`` beside ``recscale_model.py`` (whose
artifact reader and errors it uses), so it imports nothing from recscale::

    from recscale_next_item import NextItemModel   # or: from recscale.serving.next_item import
    model = NextItemModel.load("MODEL")
    items, scores = model.top_k([[5, 17, 3], [42]], k=10)   # int32 / float32 [B, k]
    scores = model.score([[5, 17, 3]], [[8, 9, 200]])        # float32 [B, C]

**A history** is a list of item ids ``1..V`` (``V = manifest["inputs"]["n_items"]``), oldest
first, at least one. One longer than the model's ``max_seq_len`` N is cut to its most recent N
events, as training cut every history, and the events cut are counted
(``counters["truncated_events"]``); an id that is not an integer in ``1..V`` is an
:class:`ArtifactError` naming the field, its index and the id.

**Programs** (``jax.export``, symbolic batch ``B``; batches are padded to the next power of two,
so a server's varying batch sizes compile a handful of programs), on ``items [B, N]`` int32 (each
history left-aligned, 0 past its length) and ``lengths [B]`` int32:

* ``top_k.jax``: ``(items [B, K], scores [B, K]) = f(weights, items, lengths, exclude [B]
  bool)``, the ``K = manifest["inputs"]["max_k"]`` best items of the whole catalogue ``1..V``,
  best first, ties to the lower id; ``exclude``: the history's own items are left out (as
  ``sequential.metrics.full_metrics`` ranks). Exact: scores of every item, a running top-K over
  chunks of the item table. Fewer than K eligible items: the rest are item 0, score ``-inf``.
* ``score.jax``: ``scores [B, C] = f(weights, items, lengths, candidates [B, C] int32)``, 0 a
  padding candidate (score ``-inf``).

A score is the training loss's logit ``<n(u), n(e_j)> / temperature``: ``u`` the model's output
at the history's last event, ``e_j`` item j's row, ``n`` the L2 normalisation where the loss
used it (``manifest["scoring"]``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

if __package__ == "recscale.serving":
    from recscale.serving.runtime import ArtifactError, Malformed, read_artifact, show
else:  # an artifact's recscale_next_item.py: the loader beside it
    from recscale_model import ArtifactError, Malformed, read_artifact, show

TASK = "next_item"
TOP_K, SCORE = "top_k.jax", "score.jax"
MAX_CANDIDATES = 256
"""Default candidates per request: :meth:`NextItemModel.score` pads every request's list to
this width (one compiled program per batch size)."""

__all__ = ["SCORE", "TASK", "TOP_K", "ArtifactError", "NextItemModel"]


class NextItemModel:
    """An exported next-item model, its weights on one device (module docstring)."""

    def __init__(
        self,
        manifest: dict,
        weights: dict[str, np.ndarray],
        programs: dict[str, Any],
        device: Any = None,
        max_candidates: int = MAX_CANDIDATES,
    ):
        self.manifest = manifest
        try:
            inputs = manifest["inputs"]
            self.n_items = int(inputs["n_items"])
            self.max_seq_len = int(inputs["max_seq_len"])
            self.max_k = int(inputs["max_k"])
        except (KeyError, TypeError, ValueError) as e:
            raise Malformed("inputs", e) from None
        if max_candidates < 1:
            raise ValueError(f"max_candidates={max_candidates}: must be >= 1")
        self.max_candidates = max_candidates
        self.device = device or jax.devices()[0]
        self.weights = jax.device_put(weights, self.device)
        self._top_k = jax.jit(programs[TOP_K].call)
        self._score = jax.jit(programs[SCORE].call)
        self._lock = threading.Lock()
        self.counters = {"requests": 0, "examples": 0, "truncated_events": 0}

    @classmethod
    def load(
        cls, path: str | Path, device: Any = None, max_candidates: int = MAX_CANDIDATES
    ) -> NextItemModel:
        """The artifact at ``path``; an :class:`ArtifactError` naming the file and field where
        it is malformed (or where it is a model of another task)."""
        path = Path(path)
        manifest, weights, programs = read_artifact(path, TASK, (TOP_K, SCORE))
        try:
            return cls(manifest, weights, programs, device, max_candidates)
        except Malformed as e:
            raise ArtifactError(f"{path / 'manifest.json'}: {e}") from None

    # -------------------------------------------------------------------- checked inputs

    def ids(self, values: Any, where: str) -> np.ndarray:
        """int64 [M]: item ids ``1..V`` from a list (or 1-D integer array); an
        :class:`ArtifactError` naming ``where``, the index and the id of the first bad one."""
        if isinstance(values, np.ndarray) and values.ndim == 1:
            if values.dtype == bool or not np.issubdtype(values.dtype, np.integer):
                raise ArtifactError(f"{where}: item ids are integers, got {values.dtype}")
            values = values.tolist()
        if not isinstance(values, list | tuple):
            raise ArtifactError(
                f"{where}: expected a list of item ids, got {type(values).__name__}"
            )
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise ArtifactError(
                    f"{where}[{i}]: item ids are integers, got {type(v).__name__} {show(v)}"
                )
            if not 1 <= v <= self.n_items:
                raise ArtifactError(
                    f"{where}[{i}]: item id {show(v)} is out of range 1..{self.n_items}"
                )
        return np.array(values, np.int64)

    def history(self, values: Any, where: str = "history") -> tuple[np.ndarray, int, int]:
        """``(items int32 [N], length, events cut)`` of one history: checked (:meth:`ids`),
        at least one event, cut to its most recent ``N``."""
        ids = self.ids(values, where)
        if ids.size == 0:
            raise ArtifactError(f"{where}: is empty (at least one item id)")
        cut = max(ids.size - self.max_seq_len, 0)
        row = np.zeros(self.max_seq_len, np.int32)
        row[: ids.size - cut] = ids[cut:]
        return row, ids.size - cut, cut

    def histories(self, histories: Any) -> tuple[np.ndarray, np.ndarray, int]:
        """``(items int32 [B, N], lengths int32 [B], events cut)`` of a list of histories."""
        if not isinstance(histories, list | tuple) or not histories:
            raise ArtifactError("histories: expected a non-empty list of histories")
        rows = [self.history(h, f"histories[{b}]") for b, h in enumerate(histories)]
        items = np.stack([r for r, _, _ in rows])
        lengths = np.array([n for _, n, _ in rows], np.int32)
        return items, lengths, sum(c for _, _, c in rows)

    def k(self, k: Any) -> int:
        """``k`` checked: an integer in ``1..max_k``."""
        if isinstance(k, bool) or not isinstance(k, int | np.integer):
            raise ArtifactError(f"k: expected an integer, got {type(k).__name__} {show(k)}")
        if not 1 <= k <= self.max_k:
            raise ArtifactError(f"k: {show(k)} is out of range 1..{self.max_k}")
        return int(k)

    def candidates(self, values: Any, where: str = "candidates") -> tuple[np.ndarray, int]:
        """``(ids int32 [max_candidates] padded with 0, count)`` of one candidate list."""
        ids = self.ids(values, where)
        if ids.size == 0 or ids.size > self.max_candidates:
            raise ArtifactError(
                f"{where}: {ids.size} item ids, expected 1..{self.max_candidates} (max_candidates)"
            )
        out = np.zeros(self.max_candidates, np.int32)
        out[: ids.size] = ids
        return out, int(ids.size)

    # -------------------------------------------------------------------- scoring

    def top_k(
        self, histories: Any, k: int = 10, exclude_history: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(items int32 [B, k], scores float32 [B, k])``: each history's ``k`` best next
        items, best first (item 0 and ``-inf`` where fewer are eligible)."""
        k = self.k(k)
        items, lengths, cut = self.histories(histories)
        self._count_cut(cut)
        exclude = np.full(items.shape[0], bool(exclude_history))
        ids, scores = self.top_k_checked(items, lengths, exclude)
        return ids[:, :k], scores[:, :k]

    def score(self, histories: Any, candidates: Any) -> np.ndarray:
        """float32 [B, C]: each history's scores of its candidates (one list per history, C
        the longest; ``-inf`` past a shorter list's end)."""
        items, lengths, cut = self.histories(histories)
        if not isinstance(candidates, list | tuple) or len(candidates) != items.shape[0]:
            raise ArtifactError(f"candidates: expected one list per history ({items.shape[0]})")
        checked = [self.candidates(c, f"candidates[{b}]") for b, c in enumerate(candidates)]
        self._count_cut(cut)
        scores = self.score_checked(items, lengths, np.stack([c for c, _ in checked]))
        return scores[:, : max(n for _, n in checked)]

    def _count_cut(self, cut: int) -> None:
        with self._lock:
            self.counters["truncated_events"] += cut

    def _run(self, fn: Any, items: np.ndarray, lengths: np.ndarray, extra: np.ndarray) -> Any:
        b = items.shape[0]
        size = 1 << max(0, (b - 1).bit_length())  # the next power of two
        if size != b:
            items = np.pad(items, ((0, size - b), (0, 0)))
            lengths = np.pad(lengths, (0, size - b), constant_values=1)
            extra = np.pad(extra, ((0, size - b),) + ((0, 0),) * (extra.ndim - 1))
        out = jax.device_get(fn(self.weights, items, lengths, extra))
        with self._lock:
            self.counters["requests"] += 1
            self.counters["examples"] += b
        return out, b

    def top_k_checked(
        self, items: np.ndarray, lengths: np.ndarray, exclude: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``top_k.jax`` on checked inputs (thread-safe): ``(items [B, max_k], scores)``."""
        (ids, scores), b = self._run(self._top_k, items, lengths, exclude)
        return np.asarray(ids)[:b], np.asarray(scores)[:b]

    def score_checked(self, items: np.ndarray, lengths: np.ndarray, cands: np.ndarray):
        """``score.jax`` on checked inputs (thread-safe): float32 [B, C]."""
        scores, b = self._run(self._score, items, lengths, cands)
        return np.asarray(scores)[:b]

    def warmup(self, max_batch: int) -> list[int]:
        """Compiles both programs for every batch size a request up to ``max_batch`` histories
        can be padded to (powers of two, candidates ``max_candidates`` wide); returns them."""
        sizes = [1 << k for k in range(max(0, (max_batch - 1).bit_length()) + 1)]
        for b in sizes:
            items = np.ones((b, self.max_seq_len), np.int32)
            lengths = np.ones(b, np.int32)
            self._top_k(self.weights, items, lengths, np.zeros(b, bool))
            self._score(self.weights, items, lengths, np.ones((b, self.max_candidates), np.int32))
        return sizes
