"""The scaling arm of the sequential families (issue 37): HSTU, SASRec and a DLRM-style bag on
small planted histories, over two decades of compute, three seeds.

DRAFT
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
