"""The scaling arm of the sequential families (issue 37): HSTU, SASRec and a DLRM-style bag
(``sequential.bag``) on small planted histories, over two decades of training compute, three
seeds, fitted with ``sweeps.analyze`` against the data's Bayes floor.

**Data** (``PLANTED``): 1,000 items, 16 tastes, histories of 10-40 items, the default process
otherwise (taste 0.4, first-order successors 0.4, a lag-4 echo 0.2; ``data.sequences.planted``).
On its 2,048 held-out users, in nats per position: Bayes 2.925, taste known 2.893, the successor
table applied to the last item 4.245, taste read from the bag 4.746, unigram 5.149 (log V =
6.908). 196,608 training users (4.9M tokens) are one epoch of fresh histories for every trial
(the largest reads 4.4M tokens). Packs of at most 1,024 tokens and 48 histories, one a step:
1,011 real tokens on average, token-weighted history length 28.2.

**Training**, the same for the three families so that losses and FLOPs compare: the full
softmax (cosine / 0.05; the eval loss is the same quantity, over every next item of the
held-out users), Adam 3e-3 on every parameter (the tables too), 5% warmup, cosine to 10%, no
dropout. The rate was chosen at 2e11 FLOPs (packs of 2,048 tokens, 100-250 steps): of 1e-3,
3e-3 and 1e-2, 3e-3 was best for the d64 sizes of all three families and within 0.10 nats of
the best (1e-2) for the d48 ones; 1e-3 was 0.10-0.45 nats worse than the best everywhere.

**Sizes** (``SIZES``, ``BAG_SIZES``; training FLOPs per token): HSTU (2 heads, d_qk = d_v =
D / 2) and SASRec (2 heads, FFN width D) cost the same at a size: d8l1 5.1e4, d16l1 1.1e5,
d32l1 2.3e5, d48l2 4.4e5, d64l4 9.2e5, d96l4 1.75e6, d128l6 3.85e6; the bag (hidden width 4D):
d8l1 5.1e4, d16l1 1.1e5, d32l1 2.4e5, d48l1 4.0e5, d64l2 9.7e5, d96l2 1.9e6, d128l3 4.7e6. The
full softmax's ``6 · D · V`` is 94% of the smallest size's cost and 16-20% of the largest's. A
sweep example is a pack (``SequentialConfig.example_cost``): 1,011 times these.

**Budgets**: 1e10 to 1e12 training FLOPs, half a decade apart; at each, every size whose run is
20-4,500 steps (an IsoFLOP grid: 4-7 sizes a budget, 27 cells a family), seeds 0, 1, 2: 243
trials. A first pilot ran three sizes a budget on a climbing diagonal and found every IsoFLOP
minimum at its window's smallest size, at 1e10 and at 1e12 alike, hence the grid.

**Cost on this 2-core CPU** (``--max-parallel 2``, other work on the machine: load 5-11).
Milliseconds per step of 1,011 tokens, measured in the pilot's trials (train and data phases,
compilation excluded; the longest run of each size), HSTU / SASRec / bag: d8 9 / 15 / 4, d16
11 / 16 / 7, d32 12 / 12 / 7, d48 22 / 31 / 8, d64 98 / 80 / 19, d96 121 / 120 / 39, d128 346 /
256 / 60 (9-15 GFLOP/s for the attention families' three largest sizes, 50-80 for the bag's,
whose matmuls are larger; the smallest sizes are bound by per-step overheads); each trial adds
about 6 s (generating the histories, two evaluations, two checkpoints) and each size's first
trial in a worker 10-30 s of compilation. Summed over the 243 trials: about 6,200
worker-seconds (6,900 with the previous pilot's step times), so 50-60 minutes of wall time with
two workers, up to about 75 if the machine's other load grows (the 27-trial pilot took 11.2
minutes, 1,320 worker-seconds, at load 7-9).

``python -m sweeps.launch sweeps.specs.seq_planted --sweep-dir runs/seq_planted --max-parallel
2`` then ``python -m sweeps.analyze runs/seq_planted`` (``sweeps.specs.seq_planted_pilot`` is
its seed-0 trials at the end budgets).

**Pilot** (``seq_planted_pilot``, seed 0), final eval loss in nats by size, the best in bold
where the IsoFLOP minimum is interior:

=======  ======================================================================
1e10     HSTU d8 5.274, d16 5.302, d32 5.594, d48 5.551; SASRec d8 5.234, d16 5.269,
         d32 5.359, d48 5.386; bag d8 5.095, d16 5.127, d32 5.183, d48 5.349
1e12     HSTU d32 3.703, **d48 3.517**, d64 3.524, d96 3.796, d128 4.044; SASRec d32
         3.873, **d48 3.765**, d64 3.802, d96 3.835, d128 4.613; bag d32 4.334,
         **d48 4.294**, d64 4.334, d96 4.357, d128 4.563
=======  ======================================================================

From 1e10 to 1e12 the best loss fell 1.76 nats for HSTU, 1.47 for SASRec and 0.80 for the bag;
at 1e12 they stand 0.59, 0.84 and 1.37 nats above the Bayes floor. The bag is best at 1e10 and
at 1e12 is below the generator's taste-from-the-bag baseline (4.746): a bag model also learns
that the successors and echoes of the items it holds are likely, which that baseline leaves to
the unigram (``sequential.bag.model``).
"""

from __future__ import annotations

from data.sequences.planted import PlantedConfig
from sequential.config import LossConfig
from sweeps.spec import FamilySpec, Rung, SweepSpec

PLANTED = PlantedConfig(n_items=1000, num_tastes=16, min_len=10, max_len=40, num_eval_users=2048)
"""The generator: 1,000 items, 16 tastes, histories of 10-40 items (the default process's
mixture, successors and lag-4 echo)."""

COMMON = {
    "model.n_items": PLANTED.n_items,
    "model.max_seq_len": PLANTED.max_len,
    "model.dropout": 0.0,  # one epoch of fresh histories: nothing to regularise
    "loss": LossConfig(kind="full_softmax"),
    "data.planted": PLANTED,
    "data.num_train_users": 196608,
    "data.token_budget": 1024,
    "data.max_sequences": 48,
    "data.eval_batch_size": 4,
    "dense_optim.learning_rate": 3e-3,
    "embedding_optim.learning_rate": 3e-3,
    "dense_optim.decay": "cosine",
    "dense_optim.end_lr_fraction": 0.1,
    "embedding_optim.decay": "cosine",
    "embedding_optim.end_lr_fraction": 0.1,
}


def _attention(d: int, layers: int, extra=None) -> Rung:
    return Rung(f"d{d}l{layers}", dict(d_model=d, num_layers=layers, num_heads=2, **(extra or {})))


def hstu_rung(d: int, layers: int) -> Rung:
    return _attention(d, layers, dict(d_qk=d // 2, d_v=d // 2))


SIZES = ((8, 1), (16, 1), (32, 1), (48, 2), (64, 4), (96, 4), (128, 6))
BAG_SIZES = ((8, 1), (16, 1), (32, 1), (48, 1), (64, 2), (96, 2), (128, 3))

HSTU = FamilySpec(
    family="hstu",
    preset="hstu/planted",
    overrides=COMMON,
    ladder=tuple(hstu_rung(*s) for s in SIZES),
)
SASREC = FamilySpec(
    family="sasrec",
    preset="sasrec/planted",
    overrides=COMMON,
    ladder=tuple(_attention(*s) for s in SIZES),
)
BAG = FamilySpec(
    family="bag",
    preset="bag/planted",
    overrides=COMMON,
    ladder=tuple(Rung(f"d{d}l{n}", dict(d_model=d, num_layers=n)) for d, n in BAG_SIZES),
)

SPEC = SweepSpec(
    name="seq_planted",
    families=(HSTU, SASREC, BAG),
    budgets=tuple(1e10 * 10 ** (i / 2) for i in range(5)),
    sizes_per_budget=0,
    seeds=(0, 1, 2),
    metric="loss",
    min_steps=20,
    max_steps=4500,
    evals_per_trial=2,
    eval_max_batches=0,
    checkpoints_per_trial=2,
    code_version="seq-planted-v1",
)
