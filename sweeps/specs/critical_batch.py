"""Issue 18's critical-batch measurement on the planted synthetic data, cut to what 2 CPU cores
run in about an hour: does the gradient noise scale predict the batch at which doubling it
stops halving the steps, for three model sizes?

DLRM at three sizes of the study's ladder (``d2``, ``d4``, ``d6``: 6,005, 15,857 and 114,577
dense parameters, 5.4e4 to 7.6e5 training FLOPs per example) trains on the same 2.1 M fresh examples at batches 256 to 16,384 (8,192 to 128
steps). The learning rates are the study's (Adam 3e-3 on the dense part, row-wise Adagrad 0.05
on the tables at batch 1,024) carried to each batch by the square-root rule, times 0.5, 1 and 2
(a small search around it); unlike the study they are held constant after a 5% warmup, so a
run's steps to a loss measure its batch, not where its decay schedule ends. 32 evaluations per
run on 16,384 held-out examples (the same ones for every run) give steps to target; the
gradient noise scale is measured 16 times per run.

``python -m sweeps.launch sweeps.specs.critical_batch --sweep-dir runs/critical_batch``, then
``python -m sweeps.batch_analysis runs/critical_batch --target-gap 0.01 --plots``: per size,
the target is the best logloss any of its runs reached plus the gap; the fitted
``S(B) = S_min (1 + B_crit / B)`` gives the measured critical batch, and the noise scale
measured where the runs reached that target gives ``B_simple``, its prediction. Results in
BENCHMARKS.md ("Large-batch training").
"""

from __future__ import annotations

import dataclasses

from sweeps.spec import SweepSpec
from sweeps.specs import study

CONSTANT = {"dense_optim.decay": "constant", "embedding_optim.decay": "constant"}

DLRM = dataclasses.replace(
    study.DLRM,
    overrides={**study.DLRM.overrides, **CONSTANT},
    ladder=(study.DLRM.ladder[1], study.DLRM.ladder[3], study.DLRM.ladder[5]),
)

SPEC = SweepSpec(
    name="critical_batch",
    families=(DLRM,),
    budgets=(1.0,),
    data=dataclasses.replace(study.DATA, batch_size=1024),
    examples_per_trial=1 << 21,
    batch_sizes=tuple(1 << k for k in range(8, 15)),
    lr_rules=("sqrt",),
    lr_multipliers=(0.5, 1.0, 2.0),
    min_steps=100,
    evals_per_trial=32,
    eval_max_batches=2,
    checkpoints_per_trial=2,
    noise_scales_per_trial=16,
    code_version="critical-batch-v1",
)
