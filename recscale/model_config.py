"""What every model family's network config shares (no jax import)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True, kw_only=True)
class TablesConfig:
    """The embedding tables' fields of every family's network config (``DLRMModelConfig``, ...),
    which ``recscale.embeddings.EmbeddingCollection.for_model`` reads with the family's own
    ``embed_dim``."""

    pooling: Literal["sum", "mean"] = "sum"
    """Pooling of multi-hot bags."""
    embedding_init: Literal["uniform_sqrt_rows", "normal"] = "uniform_sqrt_rows"
    """Table init (see recscale.embeddings.TableSpec) of every table the network has."""
    embedding_init_scale: float = 0.01
    """Std of ``normal`` table init."""

    def check_data(self, schema) -> None:
        """Raises ``ConfigError`` (a one-line message naming the flag that fixes it) when the
        network cannot be built for the dataset ``schema``; a family that needs something of the
        data overrides it. Called before the family's layers are built
        (``recscale.embeddings.family_model``) and by its cost (``recscale.flops``)."""
