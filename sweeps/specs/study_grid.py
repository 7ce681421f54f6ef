"""The scaling study's sparse/dense IsoFLOP grid: embedding capacity against dense compute.

At two budgets of ``sweeps.specs.study`` (3.2e10 and 3.2e11 training FLOPs, one seed), Wukong
is trained on every cell of a 3 x 3 x 3 grid: embedding dimension d in {8, 16, 32}, rows per
table capped at 1,000 / 10,000 / uncapped (``data.max_table_rows``: ids of larger tables are
hashed into the cap, the hashing trick; the largest table has 100,000 ids), and three dense
sizes (S, M, L: Wukong layers, FM/LC blocks, rank and MLP widths as the study's ladder grows
them). The rows cap costs no FLOPs; d and the dense size do, so at a fixed budget a cell with
more of either sees fewer examples. ``sweeps.analyze`` (``analyses=("sparse_dense",)``)
tabulates the grid and plots it as a heat map per budget with the optimum marked: where the
compute-optimal model spends its parameters, embedding rows and width or dense layers.

``python -m sweeps.launch sweeps.specs.study_grid --sweep-dir docs/study_grid --backend ray
--ray-address auto --max-parallel 2``, then ``python -m sweeps.analyze docs/study_grid``.
"""

from __future__ import annotations

import dataclasses

from sweeps.spec import Rung, wukong_rung
from sweeps.specs import study

# (layers, n_F = n_L, k, FMB MLP depth, width, dense MLP, top MLP)
DENSE = {
    "S": (2, 4, 4, 1, 64, (32,), (64, 1)),
    "M": (2, 8, 8, 1, 128, (64,), (128, 1)),
    "L": (3, 8, 8, 2, 128, (64,), (256, 1)),
}
DIMS = (8, 16, 32)
ROW_CAPS = (1000, 10000, 0)


def _rung(d: int, cap: int, size: str) -> Rung:
    rung = wukong_rung(f"d{d}/rows{cap or 'all'}/{size}", d, *DENSE[size])
    overrides = {"data.max_table_rows": cap, "data.id_policy": "hash"} if cap else {}
    return dataclasses.replace(rung, overrides=overrides)


WUKONG_GRID = dataclasses.replace(
    study.WUKONG,
    ladder=tuple(_rung(d, cap, size) for size in DENSE for d in DIMS for cap in ROW_CAPS),
)

SPEC = dataclasses.replace(
    study.SPEC,
    name="study_grid",
    families=(WUKONG_GRID,),
    budgets=(study.SPEC.budgets[3], study.SPEC.budgets[5]),
    sizes_per_budget=0,
    seeds=(0,),
    analyses=("sparse_dense",),
)
