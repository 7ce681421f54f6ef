"""The full training state round trip (issue 7, item 4): a run resumed from a checkpoint equals
the uninterrupted run bitwise for 10 further steps, and leaving any one component out of the
restore on purpose (dense optimizer moments, embedding accumulators, step / schedule counters,
the random stream, the data position, or all of them: a cold start) makes it differ.

The ablations patch ``Checkpointer.restore`` to hand the trainer a component at its fresh value,
as a trainer that did not save it would have; the faithful resume goes through the same patch
with nothing removed, so the comparison is the only thing that changes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import dlrm.presets  # noqa: F401
import wukong.presets  # noqa: F401
from dlrm.model import build_model as dlrm_build_model
from recscale.config import DenseOptimConfig, EmbeddingShardingConfig, get_preset
from recscale.train.checkpoint import Checkpointer
from recscale.train.loop import train
from recscale.train.steps import initial_rng
from tests.run_files import checkpoint_item
from wukong.model import build_model as wukong_build_model

STEPS, RESUME_AT = 16, 6


def _cfg(family: str, emb: str, opt: str):
    """A tiny run where every component matters: dropout (the random stream), Adam with warmup
    and decay (moments, schedule counter), a stateful embedding optimizer (accumulators)."""
    cfg = get_preset(f"{family}/tiny")
    model = (
        dataclasses.replace(cfg.model, dropout=0.3)
        if family == "dlrm"
        else dataclasses.replace(cfg.model, dropout=0.3, fmb_dropout=0.3)
    )
    return dataclasses.replace(
        cfg,
        model=model,
        dense_optim=DenseOptimConfig(
            name="adam", learning_rate=3e-3, warmup_steps=8, decay="cosine", end_lr_fraction=0.1
        ),
        embedding_optim=dataclasses.replace(cfg.embedding_optim, name=opt),
        embeddings=EmbeddingShardingConfig(sharding=emb),
        train=dataclasses.replace(
            cfg.train,
            num_steps=STEPS,
            log_every=1,
            progress=False,
            checkpoint_every=RESUME_AT,
            max_checkpoints=10,
        ),
    )


def _losses(workdir: Path) -> dict[int, float]:
    rows = map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def _final_params(workdir: Path):
    return checkpoint_item(workdir, STEPS)


def _where(pred, fresh):
    """An ablation of the ``opt_state`` leaves whose path satisfies ``pred``: they come back at
    ``fresh(leaf)``, their value in a freshly initialised state."""

    def ablate(trees: dict, meta: dict) -> tuple[dict, dict]:
        def f(path, x):
            return fresh(x) if pred(jax.tree_util.keystr(path)) else x

        hit = [
            p
            for p, _ in jax.tree_util.tree_flatten_with_path(trees["opt_state"])[0]
            if pred(jax.tree_util.keystr(p))
        ]
        assert hit, "the ablation matches no leaf of the optimizer state"
        opt = jax.tree_util.tree_map_with_path(f, trees["opt_state"])
        return {**trees, "opt_state": opt}, meta

    return ablate


def _zeros(x):
    return jax.device_put(np.zeros(x.shape, x.dtype), x.sharding)


def _rng(trees, meta):
    return {**trees, "rng": {"key_data": initial_rng(0)}}, meta


def _data_position(trees, meta):
    return trees, {**meta, "data_position": 0}


ABLATIONS = {
    "none": lambda trees, meta: (trees, meta),
    # Adam's first and second moments of the dense parameters.
    "dense moments": _where(lambda p: ".mu[" in p or ".nu[" in p, _zeros),
    # Row-wise Adagrad's per-row sums (dense path: sum_of_squares; engine: acc); initial 0.
    "embedding accumulators": _where(lambda p: "sum_of_squares" in p or "['acc']" in p, _zeros),
    # optax's counters: the schedule's step (warmup, decay) and Adam's bias correction.
    "step/schedule": _where(lambda p: p.endswith(".count"), _zeros),
    "rng": _rng,
    "data position": _data_position,
}


CASES = {
    # The dense path (optax row-wise Adagrad on whole tables) with every ablation, and the sharded
    # engine (row-wise over 8 devices, sparse row updates; its accumulators are the engine's own
    # buffers) with the ablations whose state it holds differently; the dense moments, counters
    # and data position are the same code on both paths.
    "dlrm-off": ("dlrm", "off", "rowwise_adagrad", dlrm_build_model, tuple(ABLATIONS)),
    "wukong-row_wise": (
        "wukong",
        "row_wise",
        "rowwise_adagrad",
        wukong_build_model,
        ("none", "embedding accumulators"),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def uninterrupted(request, tmp_path_factory):
    family, emb, opt, build, ablations = CASES[request.param]
    cfg = _cfg(family, emb, opt)
    wd = tmp_path_factory.mktemp(f"uninterrupted-{request.param}")
    train(cfg, build, wd)
    return cfg, build, wd, ablations


def _resume(cfg, build, uninterrupted_wd: Path, wd: Path, ablation, monkeypatch):
    """Trains ``cfg`` in ``wd`` from the uninterrupted run's checkpoint at ``RESUME_AT`` (copied
    there alone, as a run stopped at that step would have it), with ``ablation`` applied to what
    the trainer's restore returns."""
    wd.mkdir()
    shutil.copy(uninterrupted_wd / "config.json", wd / "config.json")
    shutil.copytree(
        uninterrupted_wd / "checkpoints" / str(RESUME_AT), wd / "checkpoints" / str(RESUME_AT)
    )
    restore = Checkpointer.restore

    def ablated_restore(self, step, likes):
        return ablation(*restore(self, step, likes))

    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "restore", ablated_restore)
        train(cfg, build, wd)


def _equal(a: dict[int, float], b: dict[int, float], params_a, params_b) -> bool:
    same_params = all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True)
    )
    return a == b and same_params


@pytest.mark.slow
def test_resume_equals_uninterrupted_and_every_component_is_needed(
    uninterrupted, tmp_path, monkeypatch
):
    cfg, build, full, ablations = uninterrupted
    full_losses = _losses(full)
    after = {s: loss for s, loss in full_losses.items() if s > RESUME_AT}
    assert sorted(after) == list(range(RESUME_AT + 1, STEPS + 1))  # 10 further steps
    full_params = _final_params(full)

    outcome = {}
    for name in ablations:
        ablation = ABLATIONS[name]
        wd = tmp_path / name.replace("/", "-").replace(" ", "-")
        _resume(cfg, build, full, wd, ablation, monkeypatch)
        losses = _losses(wd)
        assert sorted(losses) == sorted(after), name  # the resume starts at RESUME_AT + 1
        outcome[name] = _equal(losses, after, _final_params(wd), full_params)

    # The faithful resume is bitwise the uninterrupted run; leaving out any one component is not.
    assert outcome == {name: name == "none" for name in ablations}, outcome
    # And resuming is not a cold start: a run that ignored the checkpoint would take the
    # uninterrupted run's first 10 steps (same seed, same stream), not its steps 7..16.
    cold = [full_losses[s] for s in range(1, STEPS - RESUME_AT + 1)]
    assert cold != [after[s] for s in sorted(after)]
