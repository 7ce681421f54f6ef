"""Table specs (what is stored) separate from feature specs (which table a feature reads).

No jax import: configs and the (later) planner use these without it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One embedding table."""

    name: str
    """Table name (unique within a collection)."""
    num_rows: int
    """Logical rows V (valid ids are [0, V)); storage may pad rows, never used by lookups."""
    dim: int
    """Embedding dimension D."""
    init: Literal["uniform_sqrt_rows", "normal"] = "uniform_sqrt_rows"
    """``uniform_sqrt_rows``: U(-1/sqrt(V), 1/sqrt(V)) as facebookresearch/dlrm;
    ``normal``: N(0, init_scale^2)."""
    init_scale: float = 0.01
    """Standard deviation for ``normal`` init."""

    def __post_init__(self):
        if self.num_rows < 1 or self.dim < 1:
            raise ValueError(f"table {self.name!r}: num_rows and dim must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSpec:
    """One sparse feature: a multi-hot bag of ids pooled from one table."""

    name: str
    """Feature name."""
    table: str
    """Name of the table it reads (several features may share one table)."""
    max_hotness: int = 1
    """Bag slots this feature uses (slots beyond it are padding)."""
    pooling: Literal["sum", "mean"] = "sum"
    """How the bag's rows are combined; an empty bag gives the zero vector either way."""


def one_table_per_feature(
    features: tuple[tuple[str, int, int], ...],
    dim: int,
    *,
    pooling: Literal["sum", "mean"] = "sum",
    init: Literal["uniform_sqrt_rows", "normal"] = "uniform_sqrt_rows",
    init_scale: float = 0.01,
) -> tuple[tuple[TableSpec, ...], tuple[FeatureSpec, ...]]:
    """Specs for the usual layout: feature ``(name, vocab, max_hotness)`` reads table ``name``."""
    tables = tuple(
        TableSpec(name=n, num_rows=v, dim=dim, init=init, init_scale=init_scale)
        for n, v, _ in features
    )
    feats = tuple(
        FeatureSpec(name=n, table=n, max_hotness=h, pooling=pooling) for n, _, h in features
    )
    return tables, feats
