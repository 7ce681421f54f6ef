"""A sequential sweep in seconds (tests): HSTU and the bag on the */tiny planted histories, one
size each, two budgets; the bag's smaller budget is under ``min_steps`` (skipped), so three
trials.

``python -m sweeps.launch sweeps.specs.seq_tiny --sweep-dir runs/sweeps/seq_tiny`` then
``python -m sweeps.analyze runs/sweeps/seq_tiny``.
"""

from __future__ import annotations

from sweeps.spec import FamilySpec, Rung, SweepSpec

SPEC = SweepSpec(
    name="seq_tiny",
    families=(
        FamilySpec(
            family="hstu",
            preset="hstu/tiny",
            ladder=(Rung("d8", dict(d_model=8, d_qk=4, d_v=4)),),
        ),
        FamilySpec(family="bag", preset="bag/tiny", ladder=(Rung("d8", dict(d_model=8)),)),
    ),
    budgets=(4e7, 8e7),
    metric="loss",
    min_steps=5,
    evals_per_trial=1,
    checkpoints_per_trial=1,
    code_version="test",
)
