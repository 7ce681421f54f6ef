"""Where the compute-optimal sizes are: a pilot IsoFLOP grid of small models for the next study.

``sweeps.specs.study`` found every IsoFLOP minimum at the smallest size of its window, and its
loss surfaces put the optimum at 1e10-1e11 training FLOPs below its ladders for Wukong, DCNv2
and FinalMLP (1e3-7e3 FLOPs per example for Wukong, under 500 for the other two: extrapolated
far past anything run) and near them for DLRM (4e4-6e4). A study at the optimum needs its
windows placed there, so this grid measures where the minima are before it is designed:

- **Sizes**: six per family from the smallest a family can be on this data (embedding dimension
  2, one-layer MLPs of width 4: 2.9e3-3.6e3 FLOPs per example, but DLRM's 1.8e4, which its
  27-vector dot interaction and the top MLP over the 351 pairs set) up to the old ladders' third
  size (9.7e4-1.4e5), so both sides of every vertex the surfaces predict are sampled.
- **Budgets**: five a quarter decade apart, 1e10 to 1e11 training FLOPs, every size at every
  budget where it runs at least 20 steps (a full IsoFLOP grid).
- **One run per size** (``branches``): warmup-stable-decay on both optimizers (20% 1-sqrt
  cooldown, the dense rate to 10% as the study's cosine did), the largest budget's run and four
  cooldown branches per size; WSD branches beat cosine runs on the study's own rungs
  (BENCHMARKS.md). Seed 0 only: this places windows; the study repeats its points over seeds.
- Data, batch (256) and rates as ``sweeps.specs.study``; the tables on the engine.

``python -m sweeps.launch sweeps.specs.study_pilot --sweep-dir docs/study_pilot --max-parallel 2``
then ``python -m sweeps.analyze docs/study_pilot``.
"""

from __future__ import annotations

import dataclasses

from sweeps.spec import FamilySpec, dlrm_ladder, wukong_rung
from sweeps.specs import dcnv2_ladder, finalmlp_ladder, study

WSD = {
    **study.SCHEDULE,
    "dense_optim.decay": "wsd",
    "embedding_optim.decay": "wsd",
}


def _family(fam: FamilySpec, ladder) -> FamilySpec:
    return dataclasses.replace(fam, ladder=ladder, overrides={**fam.overrides, **WSD})


DLRM = _family(
    study.DLRM,
    # (d, bottom MLP, top MLP)
    dlrm_ladder(
        (
            (2, (4, 2), (4, 1)),  # 1.8e4 FLOPs/example
            (4, (4, 4), (4, 1)),  # 2.7e4
            (4, (8, 4), (8, 1)),  # 3.6e4 (the study's d1)
            (4, (16, 4), (16, 1)),  # 5.3e4 (d2)
            (8, (32, 8), (32, 1)),  # 1.1e5 (d3)
            (8, (64, 8), (40, 1)),  # 1.3e5 (d4)
        )
    ),
)
WUKONG = _family(
    study.WUKONG,
    # (d, layers, n_F = n_L, k, FMB MLP depth, width, dense MLP, top MLP)
    (
        wukong_rung("w1", 2, 1, 1, 1, 1, 4, (4,), (4, 1)),  # 2.9e3
        wukong_rung("w2", 4, 1, 1, 1, 1, 8, (8,), (8, 1)),  # 6.1e3
        wukong_rung("w3", 4, 1, 2, 2, 1, 8, (8,), (8, 1)),  # 1.1e4
        wukong_rung("w4", 4, 1, 2, 2, 1, 16, (16,), (16, 1)),  # 1.6e4 (the study's w1)
        wukong_rung("w5", 8, 1, 2, 2, 1, 32, (16,), (16, 1)),  # 3.2e4 (w2)
        wukong_rung("w6", 8, 1, 4, 4, 1, 64, (32,), (32, 1)),  # 9.7e4 (w3)
    ),
)
DCNV2 = _family(
    study.DCNV2,
    # (d, cross layers, cross rank, deep MLP)
    dcnv2_ladder(
        (
            (2, 1, 2, (4,)),  # 3.6e3
            (2, 1, 2, (8,)),  # 5.2e3
            (4, 1, 2, (8,)),  # 9.3e3
            (4, 1, 4, (16,)),  # 1.8e4 (the study's c1)
            (8, 1, 4, (16,)),  # 3.4e4 (c2)
            (8, 1, 8, (64,)),  # 1.1e5 (c3)
        )
    ),
)
FINALMLP = _family(
    study.FINALMLP,
    # (d, stream-1 MLP, stream-2 MLP, gate hidden units, fusion heads)
    finalmlp_ladder(
        (
            (2, (4,), (4,), (4,), 1),  # 3.4e3
            (2, (8,), (4,), (4,), 1),  # 5.1e3
            (4, (8,), (4,), (4,), 1),  # 8.9e3
            (4, (16,), (8,), (8,), 1),  # 1.8e4 (the study's f1)
            (4, (32,), (16,), (16,), 1),  # 3.7e4 (f2)
            (8, (64,), (32,), (16,), 1),  # 1.4e5 (f3)
        )
    ),
)

SPEC = dataclasses.replace(
    study.SPEC,
    name="study_pilot",
    families=(WUKONG, DLRM, DCNV2, FINALMLP),
    budgets=tuple(1e10 * 10 ** (i / 4) for i in range(5)),
    sizes_per_budget=0,
    extend_below=0,
    seeds=(0,),
    branches=True,
    code_version="study-pilot-v1",
)
