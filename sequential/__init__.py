"""Sequential recommenders over jagged histories: HSTU (Zhai et al., ICML 2024), SASRec
(Kang & McAuley, ICDM 2018) and a DLRM-style bag baseline, their next-item losses and ranking
metrics.

Modules: ``config`` (model and loss configs, no jax import), ``flops`` (parameters and FLOPs
per token, no jax import), ``layers`` (the shared item table, input and jagged layout),
``hstu.model``, ``sasrec.model``, ``bag.model``, ``losses`` (sampled softmax, full softmax,
BCE), ``metrics`` (HR@K, NDCG@K, MRR: full ranking and SASRec's sampled protocol), ``serving``
(the export's programs: top-K next items and candidate scores of histories). Models read a
``data.sequences.JaggedBatch``; the losses and metrics are pure functions of (model, batch).

Three registered families (``recscale.families``), ``sequential.hstu``, ``sequential.sasrec``
and ``sequential.bag`` (``model.py``, ``presets.py``, ``train.py``, ``evaluate.py``,
``export.py``), trained by the project's trainer through ``task`` (the trainer's hooks: packs of
histories from ``source``, the next-item loss, ranking metrics); their run configs are
``run_config``'s, their shared presets ``recipes``'. This package imports no jax at import
time; import the model modules for the networks.
"""

from sequential.config import BagConfig, HSTUConfig, LossConfig, SASRecConfig, SeqModelConfig
from sequential.flops import bag_cost, hstu_cost, sasrec_cost

__all__ = [
    "BagConfig",
    "HSTUConfig",
    "LossConfig",
    "SASRecConfig",
    "SeqModelConfig",
    "bag_cost",
    "hstu_cost",
    "sasrec_cost",
]
