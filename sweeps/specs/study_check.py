"""An out-of-sample test of the study's loss surface: smaller models at the top budget.

Every IsoFLOP minimum of ``sweeps.specs.study`` sat at the smallest size its budget sampled, so
the IsoFLOP parabolas could not say where the compute-optimal size is. The loss surface
L(N, D) = E + A·N^(−α) + B·D^(−β), fitted on all of the study's cells (``sweeps.surface``,
``loss_surface`` in ``docs/study/analysis.json``), can: for DLRM it puts the optimum at 1e12
FLOPs at 7.5e4 FLOPs per example [6.6e4, 8.4e4], between the ladder's d2 and d3, far below the
sizes run there (d5-d9); for Wukong at 1.6e4 [400, 5e4], the ladder's w1-w2.

This sweep runs sizes the study did not run at 1e12, chosen before their results were known:
DLRM d2 and d3 (the surface's optimum lies between them) and Wukong w4 (one below the study's
window; w1-w3 there would take 15-25 min per trial on this machine). The surface's predictions
for them (fitted on ``docs/study`` alone) are printed by ``python -m sweeps.analyze
docs/study_check --surface-from docs/study`` beside what the trials measured, with the cells the
study ran at 1e12 for comparison. Written down before the trials ran (same command, 1,000
replicates; the interval is the surface's, without a new trial's own seed noise):

    cell          N (FLOPs/ex)  D (examples)   predicted logloss   study's best at 1e12
    DLRM d2       5.35e4        18.7M          0.5144 [0.5132, 0.5155]   d5 0.5165
    DLRM d3       1.08e5         9.2M          0.5143 [0.5135, 0.5152]
    Wukong w4     1.38e5         7.2M          0.5132 [0.5120, 0.5145]   w5 0.5102

``python -m sweeps.launch sweeps.specs.study_check --sweep-dir docs/study_check --backend ray
--ray-address auto --max-parallel 2`` (about 40 minutes on 2 cores).
"""

from __future__ import annotations

import dataclasses

from sweeps.specs import study


def _rungs(fam, names: tuple[str, ...]):
    return dataclasses.replace(fam, ladder=tuple(r for r in fam.ladder if r.name in names))


SPEC = dataclasses.replace(
    study.SPEC,
    name="study_check",
    families=(_rungs(study.DLRM, ("d2", "d3")), _rungs(study.WUKONG, ("w4",))),
    budgets=study.SPEC.budgets[-1:],
    sizes_per_budget=0,
    extend_below=0,
)
