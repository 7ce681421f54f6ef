"""A batch-size sweep that runs in about a minute on 2 CPU cores (tests and the large-batch
notebook): the tiny DLRM on the */tiny data at batches 16, 64 and 256 over the same 10,240
examples (640, 160 and 40 steps), learning rates by the square-root rule and by CowClip's
recipe, the gradient noise scale measured five times per run.

``python -m sweeps.launch sweeps.specs.batch_tiny --sweep-dir runs/sweeps/batch_tiny``, then
``python -m sweeps.batch_analysis runs/sweeps/batch_tiny --target T --plots``.
"""

from __future__ import annotations

from sweeps.spec import FamilySpec, SweepSpec, dlrm_ladder

DLRM = FamilySpec(
    family="dlrm",
    preset="dlrm/tiny",
    ladder=dlrm_ladder(((8, (16, 8), (16, 1)),)),
    # The engine: CowClip and the noise scale's row gradients on the sparse path.
    overrides={"embeddings.sharding": "auto"},
)

SPEC = SweepSpec(
    name="batch_tiny",
    families=(DLRM,),
    budgets=(1.0,),
    examples_per_trial=10240,
    batch_sizes=(16, 64, 256),
    lr_rules=("sqrt", "cowclip"),
    min_steps=10,
    evals_per_trial=8,
    checkpoints_per_trial=1,
    noise_scales_per_trial=5,
)
