"""The data, optimizers and schedule that every model family's presets share (no jax import).

A family's preset pairs its network with one of these, so ``dlrm/frappe`` and ``dcnv2/frappe``
train on the same data with the same optimizers: ``DLRMConfig(model=..., **recipes.frappe())``.
Each function returns the keyword arguments ``data``, ``dense_optim``, ``embedding_optim`` and
``train`` (and ``embeddings`` for Criteo) of a family's top-level config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from data import presets as data_presets
from data.config import CRITEO_TERABYTE_VOCAB_SIZES
from recscale.config import (
    DenseOptimConfig,
    EmbeddingOptimConfig,
    EmbeddingShardingConfig,
    TrainConfig,
)

# Criteo Terabyte: days 0-22 hold about 4.2B training examples; one epoch at batch 131,072 is
# about 32,000 steps.
CRITEO_TB_BATCH = 131_072
CRITEO_TB_STEPS = 32_000


def tiny() -> dict[str, Any]:
    """The */tiny presets: ``data.presets.tiny_synthetic``, Adam 3e-3, row-wise Adagrad 0.05,
    20 steps."""
    return dict(
        data=data_presets.tiny_synthetic(),
        dense_optim=DenseOptimConfig(name="adam", learning_rate=3e-3),
        embedding_optim=EmbeddingOptimConfig(name="rowwise_adagrad", learning_rate=0.05),
        train=TrainConfig(num_steps=20, log_every=5, max_checkpoints=2),
    )


def synthetic() -> dict[str, Any]:
    """The */synthetic presets: ``data.presets.synthetic``, Adam 1e-3 with 50 warmup steps,
    row-wise Adagrad 0.05 on the tables, 3,000 steps of 1,024."""
    return dict(
        data=data_presets.synthetic(),
        dense_optim=DenseOptimConfig(name="adam", learning_rate=1e-3, warmup_steps=50),
        embedding_optim=EmbeddingOptimConfig(name="rowwise_adagrad", learning_rate=0.05),
        train=TrainConfig(
            num_steps=3000,
            log_every=100,
            eval_every=1000,
            eval_max_batches=4,
            checkpoint_every=1000,
        ),
    )


def frappe(*, num_steps: int, embedding_l2: float = 0.02) -> dict[str, Any]:
    """The */frappe presets: ``data.presets.frappe`` (batch 4,096), Adam 1e-3 on the dense part,
    Adam 1e-2 with L2 ``embedding_l2`` on the tables, cosine decay over ``num_steps``."""
    return dict(
        data=data_presets.frappe(),
        dense_optim=DenseOptimConfig(name="adam", learning_rate=1e-3, decay="cosine"),
        embedding_optim=EmbeddingOptimConfig(
            name="adam", learning_rate=1e-2, decay="cosine", l2=embedding_l2
        ),
        train=TrainConfig(num_steps=num_steps, log_every=50, eval_every=250, checkpoint_every=500),
    )


def criteo_terabyte() -> dict[str, Any]:
    """The Wukong paper's Criteo Terabyte setup (wukong/ and dcnv2/criteo-terabyte): batch
    131,072 (eval too), one epoch; Adam 1e-3 dense, row-wise Adagrad 0.1 on the tables, 10%
    linear warmup (both); the sharded engine's sparse updates for tables of up to 40M rows."""
    warmup = CRITEO_TB_STEPS // 10
    return dict(
        data=dataclasses.replace(
            data_presets.criteo(CRITEO_TERABYTE_VOCAB_SIZES, batch_size=CRITEO_TB_BATCH),
            eval_batch_size=CRITEO_TB_BATCH,
        ),
        dense_optim=DenseOptimConfig(name="adam", learning_rate=1e-3, warmup_steps=warmup),
        embedding_optim=EmbeddingOptimConfig(
            name="rowwise_adagrad", learning_rate=0.1, warmup_steps=warmup
        ),
        train=TrainConfig(
            num_steps=CRITEO_TB_STEPS, log_every=500, eval_every=0, checkpoint_every=4000
        ),
        embeddings=EmbeddingShardingConfig(sharding="auto"),
    )
