"""The one batch format every model consumes, and the dataset schema that describes it.

Shapes (dimension glossary): ``B`` batch, ``N`` dense features, ``F`` sparse features,
``H`` max hotness over all features (bag slots).

Padding convention for multi-hot ids ``ids_bfh``:
  * Valid ids are in ``[0, vocab_size_f)`` of their feature ``f``.
  * Unused bag slots hold ``PAD_ID`` (-1). Feature ``f`` only ever uses slots
    ``[0, max_hotness_f)``; slots ``[max_hotness_f, H)`` are always ``PAD_ID``.
  * Valid ids come first in a bag (left-aligned), pads after them.
  * A bag may be empty (all ``PAD_ID``); it pools to the zero vector.

``weights_b`` is 1.0 for real examples and 0.0 for padding examples (used to pad the last
evaluation batch to a fixed shape, so evaluation compiles once and counts every example once).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

PAD_ID = -1


class Batch(NamedTuple):
    """A batch of examples. NamedTuple, so it is a pytree for jax without registration."""

    dense_bn: np.ndarray
    """float32 [B, N] dense features (already transformed, e.g. log1p)."""
    ids_bfh: np.ndarray
    """int32 [B, F, H] multi-hot ids, ``PAD_ID`` in unused slots (see module docstring)."""
    labels_b: np.ndarray
    """float32 [B] binary labels in {0, 1}."""
    weights_b: np.ndarray
    """float32 [B] example weights: 1 for real examples, 0 for padding examples."""

    @property
    def batch_size(self) -> int:
        return int(self.labels_b.shape[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureInfo:
    """One sparse feature of a dataset."""

    name: str
    """Feature name (e.g. ``C1`` or ``user``)."""
    vocab_size: int
    """Number of distinct ids; valid ids are ``[0, vocab_size)``."""
    max_hotness: int = 1
    """Maximum number of ids in one bag of this feature."""
    table: str = ""
    """Embedding table the feature reads ('' = its own, named after it). Features naming one
    table share its ids and rows (they must have the same ``vocab_size``)."""

    @property
    def table_name(self) -> str:
        return self.table or self.name

    def __post_init__(self):
        if self.vocab_size < 1:
            raise ValueError(
                f"feature {self.name!r}: vocab_size must be >= 1, got {self.vocab_size}"
            )
        if self.max_hotness < 1:
            raise ValueError(
                f"feature {self.name!r}: max_hotness must be >= 1, got {self.max_hotness}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schema:
    """What a dataset's batches contain; models are built from it."""

    dense_names: tuple[str, ...]
    """Names of the dense features, in column order."""
    features: tuple[FeatureInfo, ...]
    """Sparse features, in the order of axis F of ``ids_bfh``."""

    @property
    def num_dense(self) -> int:
        return len(self.dense_names)

    @property
    def num_sparse(self) -> int:
        return len(self.features)

    @property
    def max_hotness(self) -> int:
        """H: the bag-slot axis length of ``ids_bfh``."""
        return max(f.max_hotness for f in self.features)

    def empty_batch(self, batch_size: int) -> Batch:
        """A batch of zeros with this schema's shapes (all bags empty, all weights 0)."""
        return Batch(
            dense_bn=np.zeros((batch_size, self.num_dense), np.float32),
            ids_bfh=np.full((batch_size, self.num_sparse, self.max_hotness), PAD_ID, np.int32),
            labels_b=np.zeros((batch_size,), np.float32),
            weights_b=np.zeros((batch_size,), np.float32),
        )

    def ids_in_format(self, ids_bfh: np.ndarray) -> bool:
        """Whether every id of a ``[B, F, H]`` signed-integer array is in ``[0, vocab_f)`` or the
        pad, and every slot beyond a feature's max_hotness is a pad: one vectorised pass over
        the batch (the per-feature loops that name a bad id run only when this is False)."""
        if ids_bfh.dtype not in (np.int32, np.int64) or ids_bfh.ndim != 3:
            return False
        vocab_f1 = np.array([[f.vocab_size] for f in self.features], ids_bfh.dtype)
        if ((ids_bfh < PAD_ID) | (ids_bfh >= vocab_f1)).any():
            return False
        hot_f1 = np.array([[f.max_hotness] for f in self.features])
        beyond_fh = np.arange(ids_bfh.shape[2]) >= hot_f1
        return not (beyond_fh.any() and (ids_bfh[:, beyond_fh] != PAD_ID).any())

    def validate(
        self,
        batch: Batch,
        *,
        where: str = "batch",
        example_ids: np.ndarray | None = None,
        ids_checked: bool = False,
    ) -> None:
        """Raises ValueError naming the feature and value if ``batch`` breaks the format.

        ``example_ids[i]`` names example ``i`` in the message (e.g. its record index on disk).
        ``ids_checked``: the caller found ``ids_in_format(batch.ids_bfh)`` true already (only the
        fields' shapes and dtypes are checked then).
        """
        b = batch.batch_size
        expect = {
            "dense_bn": ((b, self.num_dense), np.float32),
            "ids_bfh": ((b, self.num_sparse, self.max_hotness), np.int32),
            "labels_b": ((b,), np.float32),
            "weights_b": ((b,), np.float32),
        }
        for field, (shape, dtype) in expect.items():
            arr = getattr(batch, field)
            if tuple(arr.shape) != shape or arr.dtype != dtype:
                raise ValueError(
                    f"{where}: field {field} has shape {arr.shape} dtype {arr.dtype}, "
                    f"expected {shape} {np.dtype(dtype)}"
                )
        if ids_checked or self.ids_in_format(batch.ids_bfh):
            return
        for f, info in enumerate(self.features):
            ids = batch.ids_bfh[:, f, :]
            bad = (ids < PAD_ID) | (ids >= info.vocab_size)
            if bad.any():
                row, slot = np.argwhere(bad)[0]
                example = (
                    f"example {int(row)}"
                    if example_ids is None
                    else f"record {int(example_ids[row])}"
                )
                raise ValueError(
                    f"{where}: feature {info.name!r} (index {f}) has id {int(ids[row, slot])} at "
                    f"{example} slot {int(slot)}, outside [0, {info.vocab_size}) and not "
                    f"the pad id {PAD_ID}"
                )
            if info.max_hotness < self.max_hotness and (ids[:, info.max_hotness :] != PAD_ID).any():
                raise ValueError(
                    f"{where}: feature {info.name!r} uses slots beyond its max_hotness "
                    f"{info.max_hotness}"
                )
