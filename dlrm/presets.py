"""Named DLRM presets. Each docstring states its command and the expected result."""

from __future__ import annotations

from data import presets as data_presets
from data.config import CRITEO_KAGGLE_VOCAB_SIZES, CRITEO_TERABYTE_VOCAB_SIZES
from dlrm.config import DLRMConfig, DLRMModelConfig
from recscale import recipes
from recscale.config import (
    DenseOptimConfig,
    EmbeddingOptimConfig,
    EmbeddingShardingConfig,
    TrainConfig,
    register,
)


@register("dlrm/tiny")
def tiny() -> DLRMConfig:
    """Seconds on CPU; for tests, notebooks and dry runs.

    ``python -m dlrm.train dlrm/tiny --workdir runs/tiny`` — 20 steps, AUC above 0.5.
    """
    return DLRMConfig(
        model=DLRMModelConfig(embed_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1)),
        **recipes.tiny(),
    )


@register("dlrm/synthetic")
def synthetic() -> DLRMConfig:
    """The main job of ``make run``: planted-teacher synthetic data, multi-hot, Zipf ids.

    ``python -m dlrm.train dlrm/synthetic --workdir runs/main`` — 3,000 steps of 1,024 in under a
    minute on 2 CPU cores; eval AUC about 0.80 against the planted teacher's 0.86 (BENCHMARKS.md).
    """
    return DLRMConfig(
        model=DLRMModelConfig(embed_dim=16, bottom_mlp=(64, 32, 16), top_mlp=(128, 64, 1)),
        **recipes.synthetic(),
    )


@register("dlrm/frappe")
def frappe() -> DLRMConfig:
    """Frappe (BARS Frappe_x1) from ``../shared/data/frappe``: D=10 and a 400-400-400 top MLP as
    in BARS, the FuxiCTR form of the dot interaction (products plus every embedding), BatchNorm
    and dropout 0.2 in the top MLP (BARS's DLRM), Adam on everything with L2 on the tables,
    cosine decay, 2,000 steps of 4,096 (about 40 epochs). Found by hand search on ``valid.csv``
    (BENCHMARKS.md lists the runs); BatchNorm instead of LayerNorm added 0.0014 AUC (seed 0).

    ``python -m dlrm.train dlrm/frappe --workdir runs/frappe`` — validation AUC 0.9852 ± 0.0002,
    logloss 0.143 over 3 seeds with the embedding engine (its tables data-parallel under the
    coupled L2; the per-table reference, ``--embeddings.sharding off``, gave 0.9854 ± 0.0002 /
    0.142 beside it: BENCHMARKS.md); 5.8 minutes alone on 2 CPU cores.
    """
    return DLRMConfig(
        model=DLRMModelConfig(
            embed_dim=10,
            bottom_mlp=(),
            top_mlp=(400, 400, 400, 1),
            interaction="dot",
            dot_concat="all",
            embedding_init="normal",
            embedding_init_scale=0.01,
            dropout=0.2,
            batch_norm=True,
        ),
        **recipes.frappe(num_steps=2000),
    )


@register("dlrm/criteo-kaggle")
def criteo_kaggle() -> DLRMConfig:
    """facebookresearch/dlrm's Kaggle config: D=16, bottom 13-512-256-64-16, top 512-256-1,
    SGD lr 0.1, batch 128. Point ``--data.train-path``/``--data.eval-path`` at the raw TSVs.

    ``python -m dlrm.train dlrm/criteo-kaggle --workdir runs/kaggle --data.train-path ...``
    (reference DLRM reaches about 0.803 test AUC after one epoch).
    """
    return DLRMConfig(
        model=DLRMModelConfig(embed_dim=16, bottom_mlp=(512, 256, 64, 16), top_mlp=(512, 256, 1)),
        data=data_presets.criteo(CRITEO_KAGGLE_VOCAB_SIZES, batch_size=128),
        dense_optim=DenseOptimConfig(name="sgd", learning_rate=0.1, b1=0.0),
        embedding_optim=EmbeddingOptimConfig(name="sgd", learning_rate=0.1),
        train=TrainConfig(num_steps=306_969, log_every=1000, eval_every=0, checkpoint_every=10_000),
        # Criteo's tables (up to 40M rows) need the sharded engine's sparse updates.
        embeddings=EmbeddingShardingConfig(sharding="auto"),
    )


@register("dlrm/criteo-terabyte")
def criteo_terabyte() -> DLRMConfig:
    """facebookresearch/dlrm's Terabyte config: D=64, bottom 13-512-256-64, top 512-512-256-1,
    max_ind_range 10M, SGD lr 0.1, batch 2048.

    ``python -m dlrm.train dlrm/criteo-terabyte --workdir runs/tb --data.train-path ...``
    """
    vocab = tuple(min(v, 10_000_000) for v in CRITEO_TERABYTE_VOCAB_SIZES)
    data = data_presets.criteo(vocab, batch_size=2048)
    return DLRMConfig(
        model=DLRMModelConfig(embed_dim=64, bottom_mlp=(512, 256, 64), top_mlp=(512, 512, 256, 1)),
        data=data,
        dense_optim=DenseOptimConfig(name="sgd", learning_rate=0.1, b1=0.0),
        embedding_optim=EmbeddingOptimConfig(name="sgd", learning_rate=0.1),
        train=TrainConfig(num_steps=2_000_000, log_every=1000, checkpoint_every=20_000),
        # Criteo's tables (up to 40M rows) need the sharded engine's sparse updates.
        embeddings=EmbeddingShardingConfig(sharding="auto"),
    )


@register("dlrm/criteo-mlperf")
def criteo_mlperf() -> DLRMConfig:
    """MLPerf DLRM (v1) on Criteo Terabyte: D=128, bottom 13-512-256-128,
    top 1024-1024-512-256-1, 40M-row cap, batch 65536, SGD with warmup and decay.

    ``python -m dlrm.train dlrm/criteo-mlperf --workdir runs/mlperf --data.train-path ...``
    (MLPerf target: 0.8025 AUC).
    """
    data = data_presets.criteo(CRITEO_TERABYTE_VOCAB_SIZES, batch_size=65536)
    return DLRMConfig(
        model=DLRMModelConfig(
            embed_dim=128, bottom_mlp=(512, 256, 128), top_mlp=(1024, 1024, 512, 256, 1)
        ),
        data=data,
        dense_optim=DenseOptimConfig(
            name="sgd", learning_rate=24.0, b1=0.0, warmup_steps=2750, decay="linear"
        ),
        embedding_optim=EmbeddingOptimConfig(
            name="sgd", learning_rate=24.0, warmup_steps=2750, decay="linear"
        ),
        train=TrainConfig(num_steps=64_000, log_every=500, checkpoint_every=5000),
        # Criteo's tables (up to 40M rows) need the sharded engine's sparse updates.
        embeddings=EmbeddingShardingConfig(sharding="auto"),
    )
