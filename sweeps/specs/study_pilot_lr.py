"""Do the compute-optimal sizes want other learning rates at other run lengths? A check for the
study at the optimum, at two budgets a decade apart.

``docs/study_lr`` found the study's rule (Adam 1.5e-3, row-wise Adagrad 0.025 at batch 256)
3x too low for the first study's sizes at its two lowest budgets (20-800 steps), and the
rule's rates too high for its long runs. Branches share a size's stable phase across its
budgets, so a study with branches cannot give each budget its own rate; this checks whether it
needs to at the sizes it will run. The best size of each family in ``docs/study_pilot`` (at or
next to its smallest), trained at 1e10 and 1e11 training FLOPs (a 10x longer run: 2.7k-13.5k
steps against 27k-135k), with both rates at 1/3, 1, 3 and 10 times the rule's. The rates of a
budget train as one population (``populations``: members differ in their rates), the 1e10
points as cooldown branches of the 1e11 runs. Seed 0.

``python -m sweeps.launch sweeps.specs.study_pilot_lr --sweep-dir runs/study_pilot_lr
--max-parallel 2`` (about 9 minutes on this 2-core VM); its results are in
``docs/study_pilot_lr/results.jsonl`` and compared per rate in the README ("Where the optimum
is"); ``sweeps.analyze`` refuses it (a learning-rate search is not a grid of seeds).
"""

from __future__ import annotations

import dataclasses

from sweeps.specs import study_pilot


def _best(fam, name: str):
    return dataclasses.replace(fam, ladder=tuple(r for r in fam.ladder if r.name == name))


SPEC = dataclasses.replace(
    study_pilot.SPEC,
    name="study_pilot_lr",
    families=(
        _best(study_pilot.WUKONG, "w2"),
        _best(study_pilot.DLRM, "d1"),
        _best(study_pilot.DCNV2, "c3"),
        _best(study_pilot.FINALMLP, "f3"),
    ),
    budgets=(1e10, 1e11),
    lr_rules=("sqrt",),  # the study's rule (square root of the batch ratio for both optimizers)
    lr_multipliers=(1 / 3, 1.0, 3.0, 10.0),
    populations=True,
    code_version="study-pilot-lr-v1",
)
