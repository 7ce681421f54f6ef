"""Raw Criteo TSV reader (Kaggle Display Advertising Challenge / Terabyte); see ``reader.py``."""

from data.criteo.hashing import hash_categorical, transform_dense
from data.criteo.reader import (
    CRITEO_COLUMNS,
    CRITEO_DENSE,
    CRITEO_SPARSE,
    CriteoFormatError,
    ReadStats,
    count_criteo_rows,
    criteo_schema,
    iter_criteo_chunks,
    read_criteo,
)

__all__ = [
    "CRITEO_COLUMNS",
    "CRITEO_DENSE",
    "CRITEO_SPARSE",
    "CriteoFormatError",
    "ReadStats",
    "count_criteo_rows",
    "criteo_schema",
    "hash_categorical",
    "iter_criteo_chunks",
    "read_criteo",
    "transform_dense",
]
