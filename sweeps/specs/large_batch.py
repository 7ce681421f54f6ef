"""Issue 18's batch-size sweep on the planted synthetic data: how far the batch grows before
more examples are needed, for three model sizes each of DLRM and Wukong, and which learning-rate
recipe keeps it.

Each size trains on the same 16.8 M fresh examples (so the study is of optimisation speed, not
of data reuse) at batches 1,024 to 65,536 (16,384 to 256 steps), with the study's schedule at
its base batch of 1,024 (Adam 3e-3 on the dense part, row-wise Adagrad 0.05 on the tables, 5%
warmup, cosine decay to 10%) carried to each batch by the four recipes of ``LR_RULES`` times
0.5, 1 and 2 (a small search around each), and the gradient noise scale measured 10 times per
run. Evaluation 16 times per run, on 8,192 held-out examples, gives steps and examples to a
target (``sweeps.batch_analysis``), the fitted critical batch per recipe and size, and the noise
scale's prediction of it.

``python -m sweeps.launch sweeps.specs.large_batch --sweep-dir docs/large_batch --backend ray
--ray-address auto --max-parallel 2``, then ``python -m sweeps.batch_analysis
docs/large_batch --target T --plots``. 2 families x 3 sizes x 7 batches x 4 recipes x 3
multipliers = 504 runs, fewer where recipes coincide (at batch 1,024 ``none``, ``sqrt`` and
``linear`` are one run): far beyond two CPU cores; sized for an accelerator slice.
"""

from __future__ import annotations

import dataclasses

from sweeps.spec import SweepSpec
from sweeps.specs import study

WUKONG = dataclasses.replace(
    study.WUKONG, ladder=(study.WUKONG.ladder[1], study.WUKONG.ladder[4], study.WUKONG.ladder[7])
)
DLRM = dataclasses.replace(
    study.DLRM, ladder=(study.DLRM.ladder[1], study.DLRM.ladder[4], study.DLRM.ladder[7])
)

SPEC = SweepSpec(
    name="large_batch",
    families=(DLRM, WUKONG),
    budgets=(1.0,),
    data=dataclasses.replace(study.DATA, batch_size=1024),
    examples_per_trial=1 << 24,
    batch_sizes=tuple(1 << k for k in range(10, 17)),
    lr_rules=("none", "sqrt", "linear", "cowclip"),
    lr_multipliers=(0.5, 1.0, 2.0),
    min_steps=100,
    evals_per_trial=16,
    eval_max_batches=1,
    checkpoints_per_trial=4,
    noise_scales_per_trial=10,
    code_version="large-batch-v1",
)
