"""The study at the optimum (issue 36, part 4): IsoFLOP grids of the compute-optimal sizes that
``docs/study_pilot`` located, three seeds, warmup-stable-decay with cooldown branches and seeds
as populations.

``sweeps.specs.study`` ran every budget above its compute-optimal size, so its laws are upper
bounds. The pilot (1 seed, 1e10-1e11) found the best size of every family at or next to the
smallest it can be on this data: DCNv2 3.6e3-9.3e3 FLOPs per example, FinalMLP 3.4e3-8.9e3,
Wukong 6.1e3 (its d = 2 size fails), DLRM its floor 1.8e4. This grid is built around them:

- **Sizes**: five per family, the pilot's five smallest working sizes (one more below Wukong's
  6.1e3 with d = 4), so every budget samples both sides of the pilot's best where the family
  has a smaller size at all (DLRM does not: its 351-pair dot interaction sets its floor).
- **Budgets**: seven a quarter decade apart, 1e10 to 3.16e11 training FLOPs, every size at every
  budget (a full IsoFLOP grid: 35 points per family and seed). Below 1e10 the pilot's optimum
  is already at the smallest size, so lower budgets would measure the floor, not the optimum;
  above 3.16e11 a stable run of the smallest sizes takes over 20 minutes per population on this
  machine (1e12 is the out-of-sample check below).
- **Rates**: 3x the study's rule (Adam 4.5e-3, row-wise Adagrad 0.075 at batch 256) for every
  size and budget: ``docs/study_pilot_lr`` found 3x best at 7 of 8 points at 1e10 and at 1e11
  (10x worse everywhere), so the best rate of these sizes does not move with the run's length
  over the decade it checked, and one rate per size across its budgets (which branches need)
  costs little.
- **One run per size** (``branches``: 20% 1-sqrt cooldowns, the dense rate to 10%) and **the
  three seeds of a size as one population** (``populations``).

**Out-of-sample check, chosen before the study ran**: each family's fourth size at 1e12, a
budget the study does not run (DCNv2 c4 1.8e4, FinalMLP f4 1.8e4, Wukong w4 1.6e4, DLRM d4
5.3e4: the sizes the pilot's trend puts near the optimum a decade above its own top budget),
seed 0 (``sweeps.specs.study_opt_check``); the predictions of the study's answer law for them
are written into that spec before it runs.

``python -m sweeps.launch sweeps.specs.study_opt --sweep-dir runs/study_opt --max-parallel 2``
then ``python -m sweeps.analyze docs/study_opt``.
"""

from __future__ import annotations

import dataclasses

from sweeps.spec import FamilySpec, wukong_rung
from sweeps.specs import study_pilot


def _first(fam: FamilySpec, names: tuple[str, ...], *extra) -> FamilySpec:
    rungs = {r.name: r for r in fam.ladder}
    return dataclasses.replace(fam, ladder=(*extra, *(rungs[n] for n in names)))


WUKONG = _first(
    study_pilot.WUKONG,
    ("w2", "w3", "w4", "w5"),
    # (d, layers, n_F = n_L, k, FMB MLP depth, width, dense MLP, top MLP): w2 with width-4 MLPs
    wukong_rung("w2s", 4, 1, 1, 1, 1, 4, (4,), (4, 1)),
)
DLRM = _first(study_pilot.DLRM, ("d1", "d2", "d3", "d4", "d5"))
DCNV2 = _first(study_pilot.DCNV2, ("c1", "c2", "c3", "c4", "c5"))
FINALMLP = _first(study_pilot.FINALMLP, ("f1", "f2", "f3", "f4", "f5"))

SPEC = dataclasses.replace(
    study_pilot.SPEC,
    name="study_opt",
    families=(WUKONG, DLRM, DCNV2, FINALMLP),
    budgets=tuple(1e10 * 10 ** (i / 4) for i in range(7)),
    seeds=(0, 1, 2),
    lr_rules=("sqrt",),  # the study's rule (square root of the batch ratio for both optimizers)
    lr_multipliers=(3.0,),
    branches=True,
    populations=True,
    code_version="study-opt-v1",
)
