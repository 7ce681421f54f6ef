"""Named FinalMLP presets. Each docstring states its command and the expected result."""

from __future__ import annotations

from baselines.finalmlp.config import FinalMLPConfig, FinalMLPModelConfig
from recscale import recipes
from recscale.config import register


@register("finalmlp/tiny")
def tiny() -> FinalMLPConfig:
    """Seconds on CPU; for tests, notebooks and dry runs (the */tiny data): d=8, streams 16-16
    (dropout 0.1) and 16-8 (BatchNorm), 2 fusion heads; stream 1's gate reads feature f0's
    context embedding, stream 2's a learned context vector, so both gate kinds (and BatchNorm's
    running statistics) go through the trainer.

    ``python -m baselines.finalmlp.train finalmlp/tiny --workdir runs/finalmlp_tiny`` — 20 steps,
    finite loss, AUC above 0.5.
    """
    return FinalMLPConfig(
        model=FinalMLPModelConfig(
            embed_dim=8,
            mlp1=(16, 16),
            mlp1_dropout=0.1,
            mlp2=(16, 8),
            mlp2_batch_norm=True,
            fs_hidden_units=(16,),
            fs1_context=("f0",),
            fs2_context=(),
            num_heads=2,
        ),
        **recipes.tiny(),
    )


@register("finalmlp/frappe")
def frappe() -> FinalMLPConfig:
    """Frappe (BARS Frappe_x1) from ``../shared/data/frappe``, the network of BARS's FinalMLP
    Frappe_x1 run (FinalMLP_frappe_x1_004_e1ab402f, FuxiCTR 2.0.1): d=10 (x of 10 x 10 = 100),
    stream 1 one layer of 400, stream 2 one layer of 100, dropout 0.4 in both, gates with one
    hidden layer of 400 whose contexts are ``user`` (stream 1) and ``item`` (stream 2), 5 fusion
    heads, BatchNorm in both streams. Optimizers as dcnv2/frappe (Adam 1e-3 on the dense part;
    Adam 1e-2 with L2 0.02 on the tables; cosine decay; batch 4,096), not BARS's (Adam 1e-3 on
    everything, embedding regularizer 0.05, LR divided by 10 on plateau, early stopping); 1,500
    steps (about 30 epochs).

    ``python -m baselines.finalmlp.train finalmlp/frappe --workdir runs/finalmlp_frappe --train.no-progress``
    — validation AUC 0.9849 ± 0.0002, logloss 0.137 over 3 seeds, 3-4 minutes on 2 CPU cores
    (BENCHMARKS.md). (BARS reports test AUC 0.9861, logloss 0.148 for its run.)
    """
    return FinalMLPConfig(
        model=FinalMLPModelConfig(
            embed_dim=10,
            mlp1=(400,),
            mlp1_dropout=0.4,
            mlp1_batch_norm=True,
            mlp2=(100,),
            mlp2_dropout=0.4,
            mlp2_batch_norm=True,
            use_fs=True,
            fs_hidden_units=(400,),
            fs1_context=("user",),
            fs2_context=("item",),
            num_heads=5,
            embedding_init="normal",
            embedding_init_scale=0.01,
        ),
        **recipes.frappe(num_steps=1500),
    )
