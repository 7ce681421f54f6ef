"""The scaling study's learning-rate check: is the study's rule good at every size?

The rule (``sweeps.specs.study``): Adam 3e-3 on the dense part and row-wise Adagrad 0.05 on the
tables at batch 1,024 (the showcase's tuned values), scaled to the study's batch of 256 by the
square-root rule, the same for every size; cosine decay to 10% over each run, 5% warmup. This
sweep runs the study's trials at its two lowest budgets (every rung they use, one seed) with
both learning rates multiplied by 1/3, 1 and 3: if the rule is right, x1 is best or within
noise of the best at every size, and no size prefers a multiplier the others do not.

``python -m sweeps.launch sweeps.specs.study_lr --sweep-dir docs/study_lr --backend ray
--ray-address auto --max-parallel 2``; the table is in ``docs/study_lr/`` (``sweeps.analyze``).
"""

from __future__ import annotations

import dataclasses

from sweeps.specs import study

MULTIPLIERS = (1 / 3, 1.0, 3.0)


def _scaled(fam, m: float):
    # Run (and committed in docs/study_lr) on the dense reference update of the tables, before
    # the study moved to the embedding engine: the same updates, so the check still holds, and
    # pinning it keeps the committed trial ids, so a relaunch finds them done.
    o = dict(fam.overrides, **{"embeddings.sharding": "off"})
    o["dense_optim.learning_rate"] = o["dense_optim.learning_rate"] * m
    o["embedding_optim.learning_rate"] = o["embedding_optim.learning_rate"] * m
    return dataclasses.replace(fam, family=f"{fam.family}@lr{m:.3g}", overrides=o)


SPEC = dataclasses.replace(
    study.SPEC,
    name="study_lr",
    families=tuple(_scaled(f, m) for f in study.SPEC.families for m in MULTIPLIERS),
    budgets=study.SPEC.budgets[:2],
    # Every rung with at least min_steps steps: the study's rungs 1-4 at 1e9 and 2-5 at 3.2e9,
    # and rung 1 at 3.2e9 as well.
    sizes_per_budget=0,
    seeds=(0,),
)
