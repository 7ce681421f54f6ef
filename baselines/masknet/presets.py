"""Named MaskNet presets. Each docstring states its command and the expected result."""

from __future__ import annotations

from baselines.masknet.config import MaskNetConfig, MaskNetModelConfig
from recscale import recipes
from recscale.config import register


@register("masknet/tiny")
def tiny() -> MaskNetConfig:
    """Seconds on CPU; for tests, notebooks and dry runs (the */tiny data): d=8, a parallel
    MaskNet of 2 MaskBlocks of 8 (reduction ratio 2) and a 16-wide MLP, dropout 0.1; the 4 dense
    features enter as 4 more fields.

    ``python -m baselines.masknet.train masknet/tiny --workdir runs/masknet_tiny`` — 20 steps,
    finite loss, AUC above 0.5 (measured 0.63 on 2 shared CPU cores, seconds).
    """
    return MaskNetConfig(
        model=MaskNetModelConfig(
            embed_dim=8,
            model_type="parallel",
            parallel_num_blocks=2,
            parallel_block_dim=8,
            dnn_hidden_units=(16,),
            reduction_ratio=2.0,
            net_dropout=0.1,
        ),
        **recipes.tiny(),
    )


@register("masknet/frappe")
def frappe() -> MaskNetConfig:
    """Frappe (BARS Frappe_x1) from ``../shared/data/frappe`` with the BARS-tuned MaskNet
    (MaskNet_frappe_x1, FuxiCTR 1.2.1): d=10 (V_emb of 10 x 10 = 100), a parallel MaskNet of 3
    MaskBlocks of 50 with reduction ratio 2, net LayerNorm but no embedding LayerNorm, a
    400-400-400 MLP, dropout 0.1; dcnv2/frappe's optimizers (Adam 1e-3 on the dense part; Adam
    1e-2 with L2 0.02 on the tables, where BARS used an embedding regularizer of 0.1; cosine decay;
    batch 4,096); 1,500 steps (about 30 epochs; BARS early-stopped after 22 of 50 steps each).

    ``python -m baselines.masknet.train masknet/frappe --workdir runs/masknet_frappe --train.no-progress``
    — validation AUC 0.9839 ± 0.0002, logloss 0.154 over 3 seeds, 5-6 minutes on 2 CPU cores
    (BENCHMARKS.md). (BARS reports MaskNet test AUC 0.9837, logloss 0.1696 on
    Frappe_x1.)
    """
    return MaskNetConfig(
        model=MaskNetModelConfig(
            embed_dim=10,
            model_type="parallel",
            parallel_num_blocks=3,
            parallel_block_dim=50,
            dnn_hidden_units=(400, 400, 400),
            reduction_ratio=2.0,
            emb_layernorm=False,
            net_layernorm=True,
            net_dropout=0.1,
            embedding_init="normal",
            embedding_init_scale=0.01,
        ),
        **recipes.frappe(num_steps=1500),
    )
