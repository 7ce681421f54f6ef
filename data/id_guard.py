"""The host-side guard every batch's sparse ids pass before they can reach a device.

Why: inside jit an id outside ``[0, V)`` cannot raise. The embedding lookups treat it as padding
(``recscale/kernels/embedding_bag/reference.py``: only ``0 <= id < V`` is a valid slot) and a
plain ``jnp.take`` would clip it to row 0 or ``V - 1``, so an unchecked bad id is silently
dropped or reads the wrong row. Every :class:`~data.sources.DataSource` therefore passes its rows
through one :class:`IdGuard` on the host, where a bad id can still be named.

A *bad id* of feature ``f`` is any value outside ``[0, vocab_size_f)`` other than the pad id
``PAD_ID`` (-1, see ``data/batch.py``): ``vocab_size_f`` itself, larger ids, negative ids below
-1, and ids beyond int32 (readers may hand over int64 ids; they are checked before the cast to
the int32 batch format, so none wraps around). The policy (``DataConfig.id_policy``) says what
happens to one:

* ``reject``: ``ValueError`` naming where (e.g. ``train records``), the feature, the value, the
  example (its record index when known) and the bag slot.
* ``modulo``: replaced by ``id mod vocab_size_f`` (the mathematical modulus, so in
  ``[0, vocab_size_f)`` for negative ids too).
* ``hash``: replaced by ``splitmix64(id, f) mod vocab_size_f`` (see :func:`hash_ids`): bad ids
  congruent mod ``V`` (``modulo`` would put them all on one row) spread over the table.

Both mappings are pure numpy uint64 arithmetic, never Python's ``hash``, so they are identical
across processes and machines whatever ``PYTHONHASHSEED`` is. Valid ids and pads are never
changed. Every mapped id is counted per feature (:attr:`IdGuard.stats`, which sources expose in
their ``stats`` under ``"ids"``; the trainer writes those to ``data_stats.json``), and the first
mapping of each feature is logged.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal, get_args

import numpy as np

from data.batch import PAD_ID, Batch, Schema
from data.criteo.hashing import GOLDEN, fmix64

IdPolicy = Literal["reject", "hash", "modulo"]
"""What the guard does with a bad id (module docstring)."""
ID_POLICIES: tuple[str, ...] = get_args(IdPolicy)

_log = logging.getLogger(__name__)

_GOLDEN = np.uint64(GOLDEN)


def hash_ids(ids: np.ndarray, feature_index: np.ndarray | int, vocab_size) -> np.ndarray:
    """``fmix64(id + fmix64(f + golden)) mod vocab_size`` as int64, for int64 ``ids``.

    ``id`` is read as its two's-complement uint64, ``f`` is the feature index (so equal bad ids
    of different features land on unrelated rows); ``feature_index`` and ``vocab_size``
    broadcast against ``ids``. Deterministic: no Python ``hash``, no global state.
    """
    ids = np.asarray(ids, np.int64)
    shape = np.broadcast_shapes(ids.shape, np.shape(feature_index), np.shape(vocab_size))
    # At least 1-d: numpy warns on wrapping arithmetic of scalars, not of arrays.
    key = np.atleast_1d(ids).view(np.uint64)
    salt = fmix64(np.atleast_1d(np.asarray(feature_index, np.uint64)) + _GOLDEN)
    z = fmix64(key + salt)
    return (z % np.asarray(vocab_size, np.uint64)).astype(np.int64).reshape(shape)


class IdGuard:
    """Checks (and under ``hash`` / ``modulo`` maps) the sparse ids of batches of ``schema``.

    Thread-safe (the trainer prefetches batches on a thread). Call it on every batch, or once on
    all rows held in memory, before the batch is used.
    """

    def __init__(self, schema: Schema, policy: IdPolicy = "reject"):
        """Raises ValueError for an unknown ``policy``."""
        if policy not in ID_POLICIES:
            raise ValueError(f"id policy must be one of {ID_POLICIES}, got {policy!r}")
        self.schema = schema
        self.policy: IdPolicy = policy
        self._vocab_f = np.asarray([f.vocab_size for f in schema.features], np.int64)
        self._lock = threading.Lock()
        self.stats: dict[str, Any] = {
            "policy": policy,
            "mapped": {f.name: 0 for f in schema.features},
        }
        """``{"policy": ..., "mapped": {feature name: bad ids mapped}}``, updated in place."""

    def __call__(
        self, batch: Batch, *, where: str = "batch", example_ids: np.ndarray | None = None
    ) -> Batch:
        """``batch`` with int32 ids that are all valid or pads; raises under ``reject``.

        Args:
          batch: a batch of ``self.schema``'s shapes; ``ids_bfh`` may be of any integer dtype.
          where: names the batch in errors (e.g. ``train records``).
          example_ids: ``example_ids[i]`` names example ``i`` in errors (its record index).

        Raises:
          ValueError: a bad id under ``reject`` (naming where, feature, value, example and
            slot), or a batch that breaks the format (``Schema.validate``).
        """
        ids = np.asarray(batch.ids_bfh)
        shape = (batch.batch_size, self.schema.num_sparse, self.schema.max_hotness)
        if ids.dtype.kind not in "iu" or ids.shape != shape:
            raise ValueError(
                f"{where}: field ids_bfh has shape {ids.shape} dtype {ids.dtype}, expected "
                f"{shape} of an integer dtype"
            )
        if ids.dtype == np.uint64 and ids.size and ids.max() > np.iinfo(np.int64).max:
            raise ValueError(f"{where}: ids_bfh holds an id above int64 range: {ids.max()}")
        out = None  # a copy, made on the first bad id
        counts = [0] * shape[1]
        # Feature by feature, in the ids' own dtype: no int64 copy of all ids (the Criteo
        # Kaggle rows held in memory are 45M x 26), only of the bad ones; skipped when one
        # vectorised pass finds every id valid (the common case).
        clean = self.schema.ids_in_format(ids)
        for f, info in enumerate(() if clean else self.schema.features):
            col = ids[:, f, :]
            bad = (col < PAD_ID) | (col >= info.vocab_size)
            if not bad.any():
                continue
            values = col[bad].astype(np.int64)
            if self.policy == "reject":
                row, slot = (int(x) for x in np.argwhere(bad)[0])
                example = (
                    f"example {row}" if example_ids is None else f"record {int(example_ids[row])}"
                )
                more = f" ({values.size} bad ids of this feature here)" if values.size > 1 else ""
                raise ValueError(
                    f"{where}: feature {info.name!r} (index {f}) has id {int(values[0])} at "
                    f"{example} slot {slot}, outside [0, {info.vocab_size}) and not the pad id "
                    f"{PAD_ID}{more}; set data.id_policy='hash' or 'modulo' to map such ids "
                    f"into range"
                )
            if out is None:
                out = ids.astype(np.int32)  # bad ids may wrap here; all are overwritten below
            if self.policy == "modulo":
                out[:, f, :][bad] = np.mod(values, info.vocab_size)
            else:
                out[:, f, :][bad] = hash_ids(values, f, info.vocab_size)
            counts[f] = values.size
        if out is None:
            out = ids.astype(np.int32, copy=False)  # every id is valid or a pad: no wrap
        else:
            self._count(counts, where)
        guarded = batch._replace(ids_bfh=out)
        # The format (every field's shape and dtype, ids in range, slots beyond a feature's
        # max_hotness empty) is checked on what leaves the guard, mapped or not.
        self.schema.validate(guarded, where=where, example_ids=example_ids, ids_checked=clean)
        return guarded

    def _count(self, per_feature: list[int], where: str) -> None:
        with self._lock:
            mapped = self.stats["mapped"]
            for info, n in zip(self.schema.features, per_feature, strict=True):
                if n and not mapped[info.name]:
                    _log.warning(
                        "%s: feature %r has ids outside [0, %d); mapping them with id_policy=%r "
                        "(counted in data stats under ids.mapped)",
                        where,
                        info.name,
                        info.vocab_size,
                        self.policy,
                    )
                mapped[info.name] += n
