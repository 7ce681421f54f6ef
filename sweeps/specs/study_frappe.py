"""The scaling study's real-data arm: quality against model size on Frappe, where data is the
limit.

Frappe (BARS Frappe_x1, ``../shared/data/frappe``: 202k training and 58k validation rows, 10
categorical fields) is small: every size sees the same data, 1,000 steps of 4,096 (about 20
epochs, the Wukong preset's length and half of DLRM's and DCNv2's), at the presets' batch and
learning rates, evaluated on the whole validation split every 100 steps; the best of those
evaluations is the early-stopping number (BARS's protocol picks the best epoch too), and the gap
between it and the last one shows over-fitting. Each family keeps its Frappe preset's
regularisation and optimizers (dropout, BatchNorm, Adam with L2 on the tables, cosine decay)
and grows embedding dimension and dense part together over 5 sizes, d = 4 to 64 (the presets
use d = 10 to 64). Three seeds.

A first pass (1,200 steps of 1,024, about 6 epochs, the learning rates halved by the
square-root rule; its rows stay in ``results.jsonl`` and are not analysed) was limited by
training, not data: every one of its 60 runs was still improving at its last evaluation (by
0.003-0.019 logloss over its last 200 steps, most for the largest sizes), so it ranked how fast
each size learns, not where it saturates.

``python -m sweeps.launch sweeps.specs.study_frappe --sweep-dir docs/study_frappe --backend ray
--ray-address auto --max-parallel 2`` (needs ``../shared/data/frappe``), then ``python -m
sweeps.analyze docs/study_frappe`` (needs only the committed results).
"""

from __future__ import annotations

from sweeps.spec import FamilySpec, Rung, SweepSpec, dlrm_ladder
from sweeps.specs import dcnv2_ladder, finalmlp_ladder

# The committed runs trained with the per-table reference (one array per table, dense Adam with
# coupled L2), the default before the embedding engine became it; pinned so that the spec
# resolves to them (a relaunch skips them) and says what they ran.
PER_TABLE = {"embeddings.sharding": "off"}

WUKONG = FamilySpec(
    family="wukong",
    overrides=PER_TABLE,
    preset="wukong/frappe",
    # (d, layers, n_F = n_L, k, FMB MLP depth, width, top MLP)
    ladder=tuple(
        Rung(
            f"w{i + 1}",
            dict(
                embed_dim=d,
                num_layers=nl,
                n_fmb=n,
                n_lcb=n,
                fmb_rank=k,
                fmb_mlp_depth=dep,
                fmb_mlp_width=w,
                top_mlp=top,
            ),
        )
        for i, (d, nl, n, k, dep, w, top) in enumerate(
            (
                (4, 1, 2, 2, 1, 16, (16, 1)),
                (8, 1, 4, 4, 1, 32, (32, 1)),
                (16, 2, 4, 4, 1, 64, (64, 1)),
                (32, 2, 4, 4, 1, 64, (128, 1)),
                (64, 2, 4, 4, 1, 64, (128, 1)),
            )
        )
    ),
)
DLRM = FamilySpec(
    family="dlrm",
    overrides=PER_TABLE,
    preset="dlrm/frappe",
    # (d, bottom MLP (Frappe has no dense features), top MLP)
    ladder=dlrm_ladder(
        (
            (4, (), (16, 1)),
            (8, (), (64, 1)),
            (16, (), (128, 128, 1)),
            (32, (), (256, 128, 1)),
            (64, (), (256, 128, 1)),
        )
    ),
)
DCNV2 = FamilySpec(
    family="dcnv2",
    overrides=PER_TABLE,
    preset="dcnv2/frappe",
    # (d, cross layers, cross rank (0: full), deep MLP)
    ladder=dcnv2_ladder(
        (
            (4, 1, 0, (16,)),
            (8, 2, 0, (64, 64)),
            (16, 2, 32, (128, 128)),
            (32, 2, 32, (256, 128)),
            (64, 2, 32, (256, 128)),
        )
    ),
)
FINALMLP = FamilySpec(
    family="finalmlp",
    overrides=PER_TABLE,
    preset="finalmlp/frappe",
    # (d, stream-1 MLP, stream-2 MLP, gate hidden units, fusion heads)
    ladder=finalmlp_ladder(
        (
            (4, (16,), (8,), (16,), 1),
            (8, (64,), (32,), (64,), 2),
            (16, (128,), (64,), (128,), 2),
            (32, (256,), (128,), (128,), 4),
            (64, (256,), (128,), (128,), 4),
        )
    ),
)

SPEC = SweepSpec(
    name="study_frappe",
    families=(WUKONG, DLRM, DCNV2, FINALMLP),
    budgets=(1.0,),  # a name only: steps_per_trial fixes every run's length
    batch_size=4096,
    steps_per_trial=1000,
    min_steps=1,
    seeds=(0, 1, 2),
    evals_per_trial=10,
    eval_max_batches=0,
    checkpoints_per_trial=1,
    metric="logloss",
    analyses=("quality_vs_size",),
    code_version="study-v1",
)
