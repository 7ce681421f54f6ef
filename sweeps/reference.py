"""What a sweep's metric is measured against when its data is planted: the Bayes-optimal value
of the generator, and for planted histories the generator's baselines.

Read from the results' configs (the committed results suffice, no trial folders); each needs
every trial to read one data set (the generator's kind, settings and seed; not how it is
batched or capped).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from sweeps.table import load_results

BASELINES = ("taste_known", "last_item", "bag", "unigram")
"""The planted histories' reference predictors beside the Bayes-optimal one
(``data.sequences.planted``): one that knows the user's taste (below Bayes), and three that see
less of the history than a sequential model can."""


def _one_data(df: pd.DataFrame, keys: tuple[str, ...]) -> dict | None:
    """The ``data`` fields ``keys`` that every trial of ``df`` shares, or None."""
    if df.empty or "config" not in df:
        return None
    datas = {
        json.dumps({k: (json.loads(c).get("data") or {}).get(k) for k in keys}, sort_keys=True)
        for c in df["config"]
    }
    return json.loads(datas.pop()) if len(datas) == 1 else None


def bayes_reference(sweep_dir: str | Path, metric: str) -> float | None:
    """The planted teacher's own eval metric, when every trial of the sweep reads one planted
    dataset (synthetic CTR data; or planted histories, metric ``loss``)."""
    return bayes_reference_of(load_results(sweep_dir), metric)


def bayes_reference_of(df: pd.DataFrame, metric: str) -> float | None:
    """``bayes_reference`` of a results table (``load_results``)."""
    if metric == "loss":
        got = planted_baselines(df)
        return None if got is None else got["bayes"]
    data = _one_data(df, ("kind", "synthetic", "shuffle_seed"))
    if data is None or data.get("kind") != "synthetic":
        return None
    from data.config import SyntheticConfig  # noqa: PLC0415
    from data.synthetic import EVAL_INDEX_OFFSET, SyntheticGenerator  # noqa: PLC0415
    from recscale import config as config_lib  # noqa: PLC0415

    cfg = config_lib.from_dict(SyntheticConfig, data["synthetic"])
    gen = SyntheticGenerator(cfg, data.get("shuffle_seed", 0))
    idx = EVAL_INDEX_OFFSET + np.arange(cfg.num_eval_examples, dtype=np.int64)
    z = gen.teacher_logits(idx)
    yb = gen.examples(idx).labels_b
    if metric == "auc":
        from recscale.metrics import EvalAccumulator  # noqa: PLC0415

        acc = EvalAccumulator()
        acc.update(z, yb, np.ones_like(yb))
        return 1.0 - acc.result()["auc"]
    return float(np.mean(np.logaddexp(0.0, z) - yb * z))


def planted_baselines(df: pd.DataFrame) -> dict[str, float] | None:
    """The planted histories' reference losses (nats per position ``t >= 1`` of the held-out
    users: ``bayes`` and :data:`BASELINES`), as every trial's evaluation scores them
    (``sequential.source``: all held-out users, the unigram from the training users), when every
    trial reads one planted data set and evaluates all its held-out users; else None."""
    data = _one_data(df, ("kind", "planted", "shuffle_seed", "num_train_users", "eval_users"))
    if data is None or data.get("kind") != "planted" or data.get("eval_users"):
        return None
    from data.sequences.planted import PlantedConfig, PlantedSequences  # noqa: PLC0415
    from recscale import config as config_lib  # noqa: PLC0415

    gen = PlantedSequences(
        config_lib.from_dict(PlantedConfig, data["planted"]), seed=data.get("shuffle_seed", 0)
    )
    train = gen.train_histories(0, data["num_train_users"])
    losses = gen.losses(gen.eval_histories(), train)
    return {k: losses[k] for k in ("bayes", *BASELINES)}
