"""The study at the optimum extended to 1e12 training FLOPs (issue 36): ``sweeps.specs.study_opt``
plus a top budget, half a decade above its 3.16e11, at the sizes that still run there.

``study_opt``'s out-of-sample cells at 1e12 (``docs/study_opt_check``) came out 1.2-4.0% better
than its loss surfaces predicted, all three seeds of each: the laws of 1e10-3.16e11 do not
extrapolate. This sweep measures the IsoFLOP slice at 1e12 itself, so that the laws can be
refitted over two decades:

- **The same trials below 1e12**: every family, size, budget and seed of ``study_opt`` resolves
  to its trial id there (same code version, recipe, branches and populations), so its 420
  results are reused, not re-run.
- **At 1e12**: every size whose run is at most 450,000 steps of 256 examples (``max_steps``,
  which no ``study_opt`` point reaches: its longest is FinalMLP f1 at 3.16e11, 367,000): the
  third to fifth sizes of Wukong, DCNv2 and FinalMLP (8.9e3-3.7e4 FLOPs per example) and all
  five of DLRM. These are the sizes ``study_opt``'s IsoFLOP vertices and the check put at or
  next to the optimum there; the two smallest of the other families would need 0.6-1.2M
  steps. Three seeds, as one population per size; each is a new stable run to 1e12 whose
  smaller budgets are ``study_opt``'s branches, already run.

The check's cells (each family's fourth size) are run again here: a stable run of a branch
group warms up as its shortest budget does, so these differ from the check's single-budget
runs in their warmup only (1% of the run against 5%).

``python -m sweeps.launch sweeps.specs.study_opt_1e12 --sweep-dir runs/study_opt_1e12
--max-parallel 2`` from a sweep folder holding ``docs/study_opt``'s results, then ``python -m
sweeps.analyze docs/study_opt_1e12 --n-boot 400``.
"""

from __future__ import annotations

import dataclasses

from sweeps.specs import study_opt

SPEC = dataclasses.replace(
    study_opt.SPEC,
    name="study_opt_1e12",
    budgets=(*study_opt.SPEC.budgets, 1e12),
    max_steps=450_000,
)
