"""The data and loop settings the sequential presets share (no jax import)."""

from __future__ import annotations

from typing import Any

from data.sequences.planted import PlantedConfig
from recscale import recipes as recscale_recipes
from recscale.config import DenseOptimConfig, EmbeddingOptimConfig, TrainConfig
from sequential.run_config import SequenceDataConfig

SHARED_VIDEO = "../shared/data/sasrec/Video.txt"
"""Where the games presets look for SASRec's ``data/Video.txt`` (beside the project, as
``../shared/data/frappe``; never copied into it): override with ``--data.sasrec-path``."""

GAMES_ITEMS = 23_715
"""V of ``Video.txt`` ("Amazon Games": ``data.sequences.sasrec.PAPER_GAMES``)."""

GAMES_PACKS_PER_EPOCH = 243
"""Packs of 128 histories in an epoch of Video.txt's 31,013 users (``ceil(31013 / 128)``):
every pack of the 201 epochs at shuffle seed 0 holds 128 users within :data:`GAMES_TOKEN_BUDGET`
(so every epoch has 243 packs)."""

GAMES_TOKEN_BUDGET = 1280
"""Token slots of a games pack (``T_pad``; 10 blocks of 128). Video.txt's training histories
(cut to 50 items) average 6.9 items, so 128 users hold 875 tokens on median and 1,269 at most
over the 48,843 packs of 201 epochs at seed 0 (at seeds 1-5, 0 to 3 of those packs would exceed
1,280 tokens and close at 127 users, adding a pack to their epoch); ``128 * 50`` slots, the
most 128 histories can hold, would be 86% padding, which every per-token layer and lookup
would pay for."""

TINY_PLANTED = PlantedConfig(n_items=200, num_tastes=4, min_len=8, max_len=24, num_eval_users=64)


def tiny() -> dict[str, Any]:
    """The sequential */tiny presets: 512 planted users of 8-24 items over 200 items, 8 packs a
    step of at most 8 histories / 128 tokens (one per simulated CPU device), Adam everywhere,
    20 steps."""
    return dict(
        data=SequenceDataConfig(
            kind="planted",
            planted=TINY_PLANTED,
            num_train_users=512,
            batch_size=8,
            eval_batch_size=8,
            token_budget=128,
            max_sequences=8,
            block_size=32,
        ),
        dense_optim=DenseOptimConfig(name="adam", learning_rate=3e-3),
        embedding_optim=EmbeddingOptimConfig(name="adam", learning_rate=1e-2),
        train=TrainConfig(num_steps=20, log_every=5, max_checkpoints=2),
    )


def planted() -> dict[str, Any]:
    """The sequential */planted presets: ``PlantedConfig()`` (V = 10,000, histories of 20-100
    items; held-out Bayes-optimal loss 3.56 nats at seed 0), 65,536 training users (about 480
    packs of 8,192 tokens an epoch), Adam 1e-3 on every parameter, ``recscale.recipes.synthetic``'s
    loop (3,000 steps, an evaluation of 4 packs every 1,000)."""
    return dict(
        data=SequenceDataConfig(
            kind="planted", num_train_users=65536, token_budget=8192, max_sequences=256
        ),
        dense_optim=DenseOptimConfig(name="adam", learning_rate=1e-3),
        embedding_optim=EmbeddingOptimConfig(name="adam", learning_rate=1e-3),
        train=recscale_recipes.synthetic()["train"],  # 3,000 steps, evaluations of 4 packs
    )


def games(*, epochs: int = 201) -> dict[str, Any]:
    """SASRec's Video.txt ("Amazon Games") with SASRec's partition, batching and optimizer
    (github:kang205/SASRec ``main.py`` defaults: batch 128 users, Adam lr 1e-3, ``beta2 = 0.98``
    in its one optimizer, 201 epochs, evaluation every 20 epochs of 10,000 sampled users
    against 100 sampled negatives each):
    one pack of 128 histories (of at most 50 items, in :data:`GAMES_TOKEN_BUDGET` slots) a step;
    the validation item evaluated."""
    return dict(
        data=SequenceDataConfig(
            kind="sasrec",
            sasrec_path=SHARED_VIDEO,
            batch_size=1,
            eval_batch_size=1,
            token_budget=GAMES_TOKEN_BUDGET,
            max_sequences=128,
            eval_split="valid",
            eval_users=10_000,
            sampled_negatives=100,
        ),
        dense_optim=DenseOptimConfig(name="adam", learning_rate=1e-3, b2=0.98),
        embedding_optim=EmbeddingOptimConfig(name="adam", learning_rate=1e-3, b2=0.98),
        train=TrainConfig(
            num_steps=epochs * GAMES_PACKS_PER_EPOCH,
            log_every=GAMES_PACKS_PER_EPOCH,
            eval_every=20 * GAMES_PACKS_PER_EPOCH,
            checkpoint_every=20 * GAMES_PACKS_PER_EPOCH,
        ),
    )
