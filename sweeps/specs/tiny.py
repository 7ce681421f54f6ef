"""A sweep that runs in about a minute on a laptop: DLRM and Wukong on the */tiny data, three
rungs each, three budgets over one decade, two rungs per budget (tests and notebooks).

``python -m sweeps.launch sweeps.specs.tiny --sweep-dir runs/sweeps/tiny``
"""

from __future__ import annotations

from sweeps.spec import FamilySpec, SweepSpec, dlrm_ladder, wukong_ladder

DLRM = FamilySpec(
    family="dlrm",
    preset="dlrm/tiny",
    ladder=dlrm_ladder(((4, (8, 4), (8, 1)), (8, (16, 8), (16, 1)), (8, (32, 8), (32, 1)))),
)
WUKONG = FamilySpec(
    family="wukong",
    preset="wukong/tiny",
    ladder=wukong_ladder(((1, 2, 2, 2, 1, 8), (2, 4, 4, 4, 1, 16), (2, 8, 8, 8, 1, 32))),
)

SPEC = SweepSpec(
    name="tiny",
    families=(DLRM, WUKONG),
    budgets=(2e7, 6e7, 2e8),
    sizes_per_budget=2,
    min_steps=10,
    evals_per_trial=2,
    checkpoints_per_trial=2,
)
