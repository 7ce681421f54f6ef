"""The pilot of ``sweeps.specs.seq_planted``: seed 0 at its smallest and largest budgets (1e10
and 1e12 training FLOPs), with every size the full sweep runs there (four at 1e10, five at
1e12), so 27 trials. They are the full sweep's own (same configs, same pinned code version, so
the same ids): the full sweep launched into the pilot's folder reuses them.

``python -m sweeps.launch sweeps.specs.seq_planted_pilot --sweep-dir runs/seq_planted
--max-parallel 2`` then ``python -m sweeps.analyze runs/seq_planted``.
"""

from __future__ import annotations

import dataclasses

from sweeps.specs import seq_planted

SPEC = dataclasses.replace(
    seq_planted.SPEC,
    name="seq_planted_pilot",
    budgets=(seq_planted.SPEC.budgets[0], seq_planted.SPEC.budgets[-1]),
    seeds=(0,),
)
