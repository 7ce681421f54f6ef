"""Data for recscale: one batch format, readers, generators and input pipelines.

This package imports nothing else from the project, and nothing here imports jax at module level.
"""

from data.batch import PAD_ID, Batch, FeatureInfo, Schema
from data.config import DataConfig, SyntheticConfig

__all__ = ["PAD_ID", "Batch", "DataConfig", "FeatureInfo", "Schema", "SyntheticConfig"]
