"""The out-of-sample check of ``sweeps.specs.study_opt``: each family's fourth size at 1e12
training FLOPs, a budget the study did not run, seeds 0-2 (seed 0 ran first, alone; seeds 1 and
2 were added as one population per cell once seed 0's cells had all come out better than
predicted, to tell a lucky seed from a law that does not extrapolate).

The cells were named in ``study_opt``'s docstring before the study ran.
``python -m sweeps.analyze docs/study_opt_check --surface-from docs/study_opt`` prints the
surface's predictions beside what the trials measured.

Written before these trials ran (``docs/study_opt``, 400 replicates): the surface's prediction
with its band, and a prediction interval that adds a single seed's noise (the study's seed
standard deviation of the same size at 3.16e11, z at 95%, in quadrature); the frontier law (the
Bayes floor, the analysis's answer) at 1e12 is the best any size should reach there:

    cell          N (FLOPs/ex)  D (examples)  surface: predicted [band]   with seed noise    law at 1e12
    Wukong w4     1.59e4        63.1M         0.4850 [0.4825, 0.4891]     [0.4705, 0.4998]   0.4789
    DLRM d4       5.35e4        18.7M         0.5084 [0.5079, 0.5135]     [0.5077, 0.5135]   0.5052
    DCNv2 c4      1.78e4        56.2M         0.4811 [0.4790, 0.4834]     [0.4737, 0.4885]   0.4677
    FinalMLP f4   1.80e4        55.7M         0.4821 [0.4799, 0.4843]     [0.4704, 0.4938]   0.4704

``python -m sweeps.launch sweeps.specs.study_opt_check --sweep-dir docs/study_opt_check
--max-parallel 2`` (seed 0: about 20 minutes on 2 cores).
"""

from __future__ import annotations

import dataclasses

from sweeps.specs import study_opt

CELLS = {"wukong": "w4", "dlrm": "d4", "dcnv2": "c4", "finalmlp": "f4"}
"""Each family's size checked: its fourth in ``study_opt``."""

SPEC = dataclasses.replace(
    study_opt.SPEC,
    name="study_opt_check",
    families=tuple(
        dataclasses.replace(f, ladder=tuple(r for r in f.ladder if r.name == CELLS[f.family]))
        for f in study_opt.SPEC.families
    ),
    budgets=(1e12,),
    seeds=(0, 1, 2),
    branches=False,
    populations=True,
)
