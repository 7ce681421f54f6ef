"""Embedding tables, feature routing and pooled lookups; the sharded engine (`engine`) and its
planner (`planner`)."""

from recscale.embeddings.collection import EmbeddingCollection, EmbeddingTable
from recscale.embeddings.spec import FeatureSpec, TableSpec, one_table_per_feature

__all__ = [
    "EmbeddingCollection",
    "EmbeddingTable",
    "FeatureSpec",
    "TableSpec",
    "one_table_per_feature",
]
