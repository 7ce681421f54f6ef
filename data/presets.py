"""Dataset configs shared by every model family's presets (no jax import).

A model family's preset pairs one of these with its network, so ``dlrm/frappe`` and
``wukong/frappe`` read exactly the same data.
"""

from __future__ import annotations

from data.config import CriteoConfig, DataConfig, SyntheticConfig

SHARED_FRAPPE = "../shared/data/frappe"
"""Frappe's BARS layout beside the project (resolved against the working directory)."""


def tiny_synthetic() -> DataConfig:
    """4 dense + 4 small multi-hot features, batch 64: trains in seconds (the */tiny presets)."""
    return DataConfig(
        kind="synthetic",
        batch_size=64,
        eval_batch_size=256,
        synthetic=SyntheticConfig(
            num_dense=4,
            vocab_sizes=(100, 50, 200, 30),
            max_hotness=(1, 2, 1, 3),
            num_eval_examples=1000,
        ),
    )


def synthetic() -> DataConfig:
    """13 dense + 8 Zipf multi-hot features, batch 1,024, 65,536 held-out examples."""
    return DataConfig(
        kind="synthetic",
        batch_size=1024,
        eval_batch_size=4096,
        synthetic=SyntheticConfig(
            num_dense=13,
            vocab_sizes=(10000, 5000, 2000, 1000, 500, 200, 100, 50),
            max_hotness=(3, 1, 5, 1, 2, 1, 1, 4),
            num_eval_examples=65536,
        ),
    )


def frappe(directory: str = SHARED_FRAPPE) -> DataConfig:
    """Frappe train.csv / valid.csv, batch 4,096 (as BARS)."""
    return DataConfig(
        kind="frappe",
        train_path=f"{directory}/train.csv",
        eval_path=f"{directory}/valid.csv",
        batch_size=4096,
        eval_batch_size=8192,
    )


def criteo(vocab_sizes: tuple[int, ...], *, batch_size: int) -> DataConfig:
    """Raw Criteo TSVs hashed into ``vocab_sizes``; the paths are placeholders to override with
    ``--data.train-path`` / ``--data.eval-path``."""
    return DataConfig(
        kind="criteo",
        train_path="/path/to/criteo/train.txt",
        eval_path="/path/to/criteo/valid.txt",
        batch_size=batch_size,
        eval_batch_size=16384,
        criteo=CriteoConfig(vocab_sizes=vocab_sizes),
    )


__all__ = ["SHARED_FRAPPE", "criteo", "frappe", "synthetic", "tiny_synthetic"]
