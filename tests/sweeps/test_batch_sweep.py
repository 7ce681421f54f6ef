"""Batch-size sweeps: trials at fixed examples with each learning-rate recipe, and the analysis
of steps to target, the fitted critical batch and the measured noise scale."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from sweeps import batch_analysis
from sweeps.spec import SweepSpec, resolve
from sweeps.specs import batch_tiny


def test_trials_keep_the_examples_and_scale_rates_by_each_recipe():
    spec = dataclasses.replace(
        batch_tiny.SPEC,
        lr_rules=("none", "sqrt", "linear", "cowclip"),
        lr_multipliers=(0.5, 1.0),
        cowclip_row_l2=1e-4,
    )
    trials = resolve(spec).trials
    # 3 batches x 4 recipes x 2 multipliers; recipes that give the same run share one trial
    # (at batch 64, dlrm/tiny's own, none = sqrt = linear; at 16 and 256 some rule x0.5 equals
    # another x1).
    served = [
        (t, rule, mult) for t in trials for rule, mult in ((t.lr_rule, t.lr_multiplier), *t.also)
    ]
    assert len(served) == 3 * 4 * 2 and len(trials) == 16
    assert len({(t.batch_size, r, m) for t, r, m in served}) == 24
    base = next(t for t, r, m in served if t.batch_size == 64 and r == "none" and m == 1.0)
    d0 = base.config["dense_optim"]["learning_rate"]
    e0 = base.config["embedding_optim"]["learning_rate"]
    for t, rule, mult in served:
        assert t.examples == 10240 and t.steps == 10240 // t.batch_size
        s = t.batch_size / 64
        dpow, epow = {"none": (0, 0), "sqrt": (0.5, 0.5), "linear": (1, 1), "cowclip": (0.5, 0)}[
            rule
        ]
        opt = t.config["dense_optim"], t.config["embedding_optim"]
        assert opt[0]["learning_rate"] == pytest.approx(d0 * s**dpow * mult)
        assert opt[1]["learning_rate"] == pytest.approx(e0 * s**epow * mult)
        cow = rule == "cowclip"
        assert opt[1]["cowclip_ratio"] == (1.0 if cow else 0.0)
        assert opt[1]["row_l2"] == pytest.approx(1e-4 * s if cow else 0.0)
        assert t.config["train"]["noise_scale_every"] == max(t.steps // 5, 1)
    assert len({t.trial_id for t in trials}) == len(trials)
    with pytest.raises(ValueError, match="unknown recipe 'cosine'"):
        SweepSpec(name="x", families=spec.families, budgets=(1.0,), lr_rules=("cosine",))


def test_the_critical_batch_fit_recovers_planted_curves():
    b = np.array([256, 1024, 4096, 16384])
    got = batch_analysis.fit_critical_batch(b, 100 * (1 + 2000 / b))
    assert got["s_min"] == pytest.approx(100) and got["b_crit"] == pytest.approx(2000)
    assert got["e_min"] == pytest.approx(2e5)
    assert math.isinf(batch_analysis.fit_critical_batch(b, 1e6 / b)["b_crit"])  # perfect scaling
    assert math.isnan(batch_analysis.fit_critical_batch(b, np.full(4, 50.0))["b_crit"])
    assert math.isnan(batch_analysis.fit_critical_batch(b[:1], b[:1])["b_crit"])


def test_analysis_of_a_sweep_directory(tmp_path):
    """Steps to target per recipe and batch (the best multiplier whose every seed reached it)
    and the late-run noise scale, from trial files as the launcher writes them."""
    results = []

    def trial(tid, batch, rule, mult, seed, evals, noise=(), also=()):
        d = tmp_path / "trials" / tid
        (d / "run").mkdir(parents=True)
        t = {
            "trial_id": tid,
            "family": "dlrm",
            "rung": "d1",
            "batch_size": batch,
            "seed": seed,
            "lr_rule": rule,
            "lr_multiplier": mult,
            "steps": 100,
            "also": also,
        }
        (d / "trial.json").write_text(json.dumps(t))
        rows = [{"split": "eval", "step": s, "logloss": v} for s, v in evals]
        rows += [
            {
                "split": "noise_scale",
                "step": s,
                "noise_scale/dense": v,
                "noise_scale/embedding": 10 * v,
            }
            for s, v in noise
        ]
        (d / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        results.append({"trial_id": tid, "status": "SUCCESS"})

    trial("a", 64, "sqrt", 1.0, 0, [(50, 0.6), (100, 0.5)], noise=[(10, 1.0), (60, 3.0), (90, 5.0)])
    trial(
        "b",
        64,
        "sqrt",
        2.0,
        0,
        [(50, 0.5), (100, 0.45)],  # reaches 0.5 sooner: counts
        also=[["none", 2.0]],
    )  # the same run serves the "none" recipe too
    trial("c", 256, "sqrt", 1.0, 0, [(10, 0.5)])
    trial("d", 256, "sqrt", 1.0, 1, [(10, 0.7)])  # a seed that never reaches it: x1 is out
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    out = batch_analysis.analyze(tmp_path, target=0.5)
    none, rec = out["recipes"]
    assert (none["recipe"], rec["recipe"]) == ("none", "sqrt")
    assert none["points"] == [
        {"batch": 64, "steps": 50.0, "examples": 3200.0, "lr_multiplier": 2.0}
    ]
    assert rec["points"][0] == {
        "batch": 64,
        "steps": 50.0,
        "examples": 3200.0,
        "lr_multiplier": 2.0,
    }
    assert rec["points"][1]["steps"] is None
    (ns,) = out["noise_scale"]
    assert ns["batch"] == 64 and ns["b_simple_dense"] == pytest.approx(4.0)  # steps >= 50
    assert ns["b_simple_embedding"] == pytest.approx(40.0)


def test_the_large_batch_spec_resolves_every_recipe_point():
    from sweeps.specs import large_batch

    trials = resolve(large_batch.SPEC).trials
    served = {
        (t.family, t.rung, t.batch_size, r, m)
        for t in trials
        for r, m in ((t.lr_rule, t.lr_multiplier), *t.also)
    }
    assert len(served) == 2 * 3 * 7 * 4 * 3
    assert {t.examples for t in trials} == {1 << 24}
    assert {t.batch_size for t in trials} == {1 << k for k in range(10, 17)}


def test_targets_per_size_and_the_noise_scale_where_runs_reach_them(tmp_path):
    """``target_gap``: each size's target is its runs' best logloss plus the gap; steps to it are
    interpolated between evaluations; ``B_simple`` at the target pools the measurements' own
    ``|G|²`` and ``tr(Σ)`` taken within a factor 2 of the step each run reached it."""
    results = []

    def trial(tid, rung, batch, evals, noise):
        d = tmp_path / "trials" / tid
        (d / "run").mkdir(parents=True)
        t = {
            "trial_id": tid,
            "family": "dlrm",
            "rung": rung,
            "batch_size": batch,
            "seed": 0,
            "lr_rule": "sqrt",
            "lr_multiplier": 1.0,
            "steps": 400,
            "also": [],
        }
        (d / "trial.json").write_text(json.dumps(t))
        rows = [{"split": "eval", "step": s, "logloss": v} for s, v in evals]
        rows += [
            {
                "split": "noise_scale",
                "step": s,
                "noise_scale/dense/g2_now": g,
                "noise_scale/dense/trace_now": tr,
                "noise_scale/embedding/g2_now": ge,
                "noise_scale/embedding/trace_now": te,
            }
            for s, g, tr, ge, te in noise
        ]
        (d / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        results.append({"trial_id": tid, "status": "SUCCESS"})

    # small: best 0.40, target 0.41, crossed between steps 100 (0.45) and 200 (0.40) at 180;
    # measurements at steps 90..360 count (90 and 400 do not: outside [90, 360])
    trial(
        "a",
        "small",
        64,
        [(100, 0.45), (200, 0.40)],
        [
            (80, 1.0, 1e6, 0.0, 0.0),
            (100, 2.0, 100.0, -1.0, 400.0),
            (300, 4.0, 300.0, 1.0, 800.0),
            (400, 1.0, 1e6, 0.0, 0.0),
        ],
    )
    # big: its own best 0.30 (target 0.31), reached at the first evaluation
    trial("b", "big", 64, [(50, 0.30), (100, 0.35)], [])
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    out = batch_analysis.analyze(tmp_path, target_gap=0.01)
    big, small = out["recipes"]
    assert small["target"] == pytest.approx(0.41) and big["target"] == pytest.approx(0.31)
    assert small["points"][0]["steps"] == pytest.approx(180.0)
    assert big["points"][0]["steps"] == 50.0
    (ns,) = out["noise_at_target"]
    assert (ns["rung"], ns["measurements"], ns["runs"]) == ("small", 2, 1)
    assert ns["b_simple_dense"] == pytest.approx(200.0 / 3.0)  # mean trace 200 / mean |G|² 3
    assert math.isnan(ns["b_simple_embedding"])  # its mean |G|² is 0: not resolved
    assert math.isinf(ns["b_simple_embedding_hi"])  # most resamples: |G|² <= 0
    assert ns["b_simple_total"] == pytest.approx((200.0 + 600.0) / 3.0)
    assert ns["b_simple_dense_lo"] <= ns["b_simple_dense"] <= ns["b_simple_dense_hi"]
    with pytest.raises(ValueError, match="exactly one"):
        batch_analysis.analyze(tmp_path, target=0.4, target_gap=0.01)
