"""``make run``'s sweep: Wukong vs DLRM vs DCNv2 on planted third-order synthetic data.

The data's teacher logit has first-, second- and third-order terms (``interaction_order=3``,
see ``data/synthetic.py``), so a model that builds higher-order crosses (Wukong's stacked FM
blocks, DCNv2's cross layers) has something to find that DLRM's pairwise dot products do not.

Design (an IsoFLOP grid): seven budgets a quarter decade apart over 1.5 decades of training
FLOPs; each family has a ladder of five sizes about 3x apart in training FLOPs per example; at
each budget every size whose run is between 100 and 5,000 steps of 1,024 examples is trained
(``min_steps`` / ``max_steps``), so each budget has a 3-4 point IsoFLOP curve and the frontier
(best size per budget) is what the scaling law is fitted to.

One run per size serves all of its budgets (``branches``, ``recscale.train.branches``): a
warmup-stable-decay schedule whose stable phase runs to the size's largest budget, and for every
smaller budget a cooldown branch that trains only the last 20% of its steps. Each point is
bitwise the one-piece run of its budget; the grid costs each size its largest run plus 20% of
the others, so its quarter-decade budgets cost less than the five separate runs per size of
the cosine design before (``BENCHMARKS.md``, "make run").

``python -m sweeps.launch sweeps.specs.showcase --max-parallel 2`` then
``python -m sweeps.analyze runs/sweeps/showcase`` (``make run`` does both).
"""

from __future__ import annotations

from data.config import DataConfig, SyntheticConfig
from sweeps.spec import FamilySpec, SweepSpec, dlrm_ladder, wukong_rung
from sweeps.specs import dcnv2_ladder

DATA = DataConfig(
    kind="synthetic",
    batch_size=1024,
    eval_batch_size=8192,
    synthetic=SyntheticConfig(
        num_dense=8,
        vocab_sizes=(1000, 500, 200, 100, 50, 20, 20, 10),
        max_hotness=(3, 1, 2, 1, 1, 1, 2, 1),
        interaction_order=3,
        order_scales=(1.0, 1.0, 1.5),
        num_eval_examples=32768,
    ),
)

# Every point decays its rates over its own last 20% of steps (1-sqrt; the dense rate to 10%,
# as the cosine schedule before it); 3e-3 is better than the presets' 1e-3 for runs this short
# (DLRM at 1,030 steps: logloss 0.4561 at 1e-3 constant, 0.4420 at 3e-3 cosine).
SCHEDULE = {
    "dense_optim.learning_rate": 3e-3,
    "dense_optim.decay": "wsd",
    "dense_optim.end_lr_fraction": 0.1,
    "embedding_optim.decay": "wsd",
}


WUKONG = FamilySpec(
    family="wukong",
    preset="wukong/synthetic",
    overrides=SCHEDULE,
    # As the paper's Table 5 grows it: layers first, then n_F = n_L and k, then the FMB MLP;
    # the two smallest rungs also shrink d and the small MLPs to reach DLRM's smallest cost.
    ladder=(
        wukong_rung("w1", 8, 1, 2, 2, 1, 16, (16,), (16, 1)),  # 1.2e4 FLOPs/example
        wukong_rung("w2", 8, 1, 4, 4, 1, 32, (16,), (32, 1)),  # 3.6e4
        wukong_rung("w3", 16, 2, 4, 4, 1, 32, (32,), (64, 1)),  # 1.2e5
        wukong_rung("w4", 16, 2, 8, 8, 1, 64, (32,), (64, 1)),  # 3.5e5
        wukong_rung("w5", 16, 3, 8, 8, 2, 128, (32,), (64, 1)),  # 1.05e6
    ),
)
DLRM = FamilySpec(
    family="dlrm",
    preset="dlrm/synthetic",
    overrides=SCHEDULE,
    # (embedding dim, bottom MLP, top MLP).
    ladder=dlrm_ladder(
        (
            (4, (16, 4), (16, 1)),  # 7.1e3
            (8, (32, 8), (64, 1)),  # 2.4e4
            (8, (64, 8), (128, 64, 1)),  # 9.4e4
            (16, (128, 16), (256, 128, 1)),  # 3.0e5
            (16, (256, 128, 16), (512, 256, 1)),  # 1.2e6
        )
    ),
)
DCNV2 = FamilySpec(
    family="dcnv2",
    preset="dcnv2/synthetic",
    overrides=SCHEDULE,
    # (embedding dim, cross layers, cross rank, deep MLP): cross depth and MLP grow together.
    ladder=dcnv2_ladder(
        (
            (8, 1, 4, (16,)),  # 1.1e4
            (8, 2, 8, (64, 32)),  # 5.5e4
            (16, 2, 16, (128, 64)),  # 2.1e5
            (16, 3, 16, (256, 128)),  # 4.9e5
            (16, 3, 32, (512, 256)),  # 1.4e6
        )
    ),
)

SPEC = SweepSpec(
    name="showcase",
    families=(WUKONG, DLRM, DCNV2),
    data=DATA,
    budgets=tuple(1e10 * 10 ** (i / 4) for i in range(7)),
    branches=True,
    sizes_per_budget=0,
    min_steps=100,
    max_steps=5000,
    evals_per_trial=4,
    eval_max_batches=1,
    checkpoints_per_trial=2,
)
