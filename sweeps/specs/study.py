"""The scaling study (issue 15): Wukong, DLRM, DCNv2 and FinalMLP over three decades of compute.

Does Wukong keep improving with compute where DLRM and DCNv2 flatten (the Wukong paper's Fig. 1)?

**Data**: the planted generator (``data/synthetic.py``), fresh examples for every step (no
epoch is ever repeated, so the study is compute-limited, not data-limited), with Criteo's
shape: 26 sparse features with tables from 10 to 100,000 rows (201k in all), Zipf(1.1) ids,
five multi-hot bags (up to 5 ids, uniform bag sizes), 13 dense features. The teacher's logit has
terms of order 1 to 4 (``interaction_order=4``), each scaled to the same standard deviation
(``order_scales=(1, 1, 1, 1)``): half of the logit's variance is in 3- and 4-way interactions of
field latent vectors, which pairwise models (DLRM's dot products, FinalMLP's bilinear fusion)
can reach only through their MLPs, while Wukong's stacked FM blocks build them by construction
(2^l-order after l layers) and DCNv2's cross layers add one order per layer. With equal term
scales no single order dominates, so what a model gains from each order shows in its loss. The
Bayes-optimal predictor is the teacher's logit: its eval logloss (0.3918, 65,536 held-out
examples) is the floor every law is also fitted with. The base rate's logloss is 0.558.

**Ladders**: 9 sizes per family, from 1.6e4 to 1.2e7 training FLOPs per example, growing the
embedding dimension (4 to 32) together with the dense part, so no family is held at a size that
handicaps it.

**Budgets and grid**: 7 budgets half a decade apart, 1e9 to 1e12 training FLOPs; at each, the 4
sizes of a diagonal window that climbs the ladder with the budget plus one size below it
(``extend_below``: a first pass found the minima at the windows' lower edge), 3 seeds each; a
run shorter than 20 steps is skipped. Batch 256 throughout.

**Learning rates**: one rule for every size: Adam 3e-3 on the dense part and row-wise Adagrad
0.05 on the tables at batch 1,024 (the showcase's tuned values), scaled to batch 256 by the
square-root rule (1.5e-3 and 0.025), 5% warmup, cosine decay to 10% over each run's own length.
``sweeps.specs.study_lr`` checks it at the two lowest budgets (results in ``docs/study_lr``).

``ray start --head --num-cpus 2``, then ``python -m sweeps.launch sweeps.specs.study --sweep-dir
docs/study --backend ray --ray-address auto --max-parallel 2``, then ``python -m sweeps.analyze
docs/study``.
"""

from __future__ import annotations

import dataclasses

from data.config import DataConfig, SyntheticConfig
from sweeps.spec import FamilySpec, SweepSpec, Trial, dlrm_ladder, resolve, wukong_rung
from sweeps.specs import dcnv2_ladder, finalmlp_ladder

VOCAB = (
    100000,
    50000,
    20000,
    10000,
    5000,
    5000,
    2000,
    2000,
    1000,
    1000,
    1000,
    1000,
    500,
    500,
    500,
    500,
    200,
    200,
    200,
    200,
    100,
    100,
    100,
    50,
    20,
    10,
)
HOTNESS = (1, 1, 3, 1, 5, 1, 1, 2, 1, 1, 3, 1, 1, 1, 4, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1)

DATA = DataConfig(
    kind="synthetic",
    batch_size=1024,
    eval_batch_size=8192,
    synthetic=SyntheticConfig(
        num_dense=13,
        vocab_sizes=VOCAB,
        max_hotness=HOTNESS,
        teacher_dim=8,
        interaction_order=4,
        order_scales=(1.0, 1.0, 1.0, 1.0),
        num_eval_examples=65536,
    ),
)

# Trial ids hash the resolved config, the data and this string instead of the git commit, so
# the study can be run in pieces across commits (a relaunch skips what results.jsonl holds).
# Bump it whenever a change to the trainer, a model or the generator changes what a trial
# computes.
CODE_VERSION = "study-v1"

SCHEDULE = {
    "data.batch_size": 1024,
    "dense_optim.name": "adam",
    "dense_optim.learning_rate": 3e-3,
    "dense_optim.decay": "cosine",
    "dense_optim.end_lr_fraction": 0.1,
    "embedding_optim.name": "rowwise_adagrad",
    "embedding_optim.learning_rate": 0.05,
    # The embedding engine: sparse row-wise Adagrad on the rows a batch touches (the same
    # updates as the dense reference path, whose full-table update made a small model's step
    # 12 ms instead of 4 at batch 256 on 2 cores).
    "embeddings.sharding": "auto",
}


WUKONG = FamilySpec(
    family="wukong",
    preset="wukong/synthetic",
    overrides=SCHEDULE,
    # (d, layers, n_F = n_L, k, FMB MLP depth, width, dense MLP, top MLP)
    ladder=(
        wukong_rung("w1", 4, 1, 2, 2, 1, 16, (16,), (16, 1)),
        wukong_rung("w2", 8, 1, 2, 2, 1, 32, (16,), (16, 1)),
        wukong_rung("w3", 8, 1, 4, 4, 1, 64, (32,), (32, 1)),
        wukong_rung("w4", 8, 2, 4, 4, 1, 64, (32,), (64, 1)),
        wukong_rung("w5", 16, 2, 6, 6, 1, 64, (32,), (64, 1)),
        wukong_rung("w6", 16, 2, 8, 8, 1, 128, (64,), (128, 1)),
        wukong_rung("w7", 16, 3, 8, 8, 2, 128, (64,), (256, 1)),
        wukong_rung("w8", 32, 3, 8, 8, 2, 256, (64,), (256, 1)),
        wukong_rung("w9", 32, 3, 16, 16, 2, 256, (128,), (512, 1)),
    ),
)
DLRM = FamilySpec(
    family="dlrm",
    preset="dlrm/synthetic",
    overrides=SCHEDULE,
    # (d, bottom MLP, top MLP)
    ladder=dlrm_ladder(
        (
            (4, (8, 4), (8, 1)),
            (4, (16, 4), (16, 1)),
            (8, (32, 8), (32, 1)),
            (8, (64, 8), (40, 1)),
            (16, (64, 16), (128, 1)),
            (16, (128, 16), (256, 64, 1)),
            (16, (128, 16), (512, 256, 1)),
            (32, (256, 32), (1024, 256, 1)),
            (32, (256, 32), (1024, 1024, 1)),
        )
    ),
)
DCNV2 = FamilySpec(
    family="dcnv2",
    preset="dcnv2/synthetic",
    overrides=SCHEDULE,
    # (d, cross layers, cross rank, deep MLP)
    ladder=dcnv2_ladder(
        (
            (4, 1, 4, (16,)),
            (8, 1, 4, (16,)),
            (8, 1, 8, (64,)),
            (8, 2, 8, (64, 32)),
            (16, 2, 8, (96, 48)),
            (16, 2, 32, (256, 128)),
            (16, 3, 32, (512, 256)),
            (32, 3, 32, (512, 256)),
            (32, 3, 64, (1024, 512)),
        )
    ),
)
FINALMLP = FamilySpec(
    family="finalmlp",
    preset="finalmlp/tiny",
    overrides={
        **SCHEDULE,
        "model.mlp1_dropout": 0.0,
        "model.mlp2_batch_norm": False,
        "model.fs1_context": (),
        "model.fs2_context": (),
    },
    # (d, stream-1 MLP, stream-2 MLP, gate hidden units, fusion heads)
    ladder=finalmlp_ladder(
        (
            (4, (16,), (8,), (8,), 1),
            (4, (32,), (16,), (16,), 1),
            (8, (64,), (32,), (16,), 1),
            (8, (64,), (48,), (24,), 1),
            (16, (96, 48), (48,), (32,), 2),
            (16, (256, 128), (128,), (64,), 2),
            (16, (512, 256), (256,), (128,), 4),
            (32, (512, 256), (256, 128), (128,), 4),
            (32, (1024, 512), (512, 256), (256,), 4),
        )
    ),
)

SPEC = SweepSpec(
    name="study",
    families=(WUKONG, DLRM, DCNV2, FINALMLP),
    data=DATA,
    batch_size=256,
    # Seven budgets half a decade apart: 1e9 to 1e12 training FLOPs.
    budgets=tuple(1e9 * 10 ** (0.5 * i) for i in range(7)),
    sizes_per_budget=4,
    # A first pass found every IsoFLOP minimum at the window's lower edge: one more size below.
    extend_below=1,
    seeds=(0, 1, 2),
    min_steps=20,
    evals_per_trial=2,
    eval_max_batches=1,
    checkpoints_per_trial=2,
    code_version=CODE_VERSION,
)


def trial_per_rung(batch_size: int) -> dict[str, Trial]:
    """One trial of every rung of every family at ``batch_size`` (seed 0, no budget window), by
    rung name: what the benchmarks that time a study model's step train."""
    spec = dataclasses.replace(
        SPEC,
        budgets=(1e12,),
        sizes_per_budget=0,
        min_steps=0,
        extend_below=0,
        seeds=(0,),
        batch_size=batch_size,
    )
    return {t.rung: t for t in resolve(spec).trials}
