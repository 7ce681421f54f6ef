"""Seeds as a vmapped population (``recscale.train.population``): every member equals its
separate run (DLRM and Wukong on the embedding engine, each member with its own seed and
learning rates), a population resumes from its members' checkpoints as it would have gone on,
branches as one, and refuses what it does not run."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

import dlrm.presets  # noqa: F401
import wukong.presets  # noqa: F401
from dlrm.model import build_model as build_dlrm
from recscale import config as config_lib
from recscale.config import get_preset
from recscale.train import branches, population
from recscale.train.checkpoint import CheckpointCorruptError
from recscale.train.loop import train
from recscale.train.population import check_members, train_population
from tests.run_files import checkpoint_item, metric_rows
from wukong.model import build_model as build_wukong

STEPS = 12
LRS = ((3e-3, 0.05), (1e-3, 0.1))  # (dense, embedding) of members 0 and 1


def _cfg(preset: str, seed: int, lrs=(3e-3, 0.05), **train):
    """``preset`` on the engine, its state all in play: dropout (the random stream), Adam with
    warmup, row-wise Adagrad, both on wsd schedules."""
    cfg = get_preset(preset)
    model = cfg.model
    if hasattr(model, "dropout"):
        model = dataclasses.replace(model, dropout=0.3)
    return dataclasses.replace(
        cfg,
        model=model,
        embeddings=dataclasses.replace(cfg.embeddings, sharding="auto"),
        dense_optim=dataclasses.replace(
            cfg.dense_optim, learning_rate=lrs[0], warmup_steps=2, decay="wsd"
        ),
        embedding_optim=dataclasses.replace(cfg.embedding_optim, learning_rate=lrs[1], decay="wsd"),
        train=dataclasses.replace(
            cfg.train,
            seed=seed,
            num_steps=STEPS,
            progress=False,
            log_every=1,
            eval_every=6,
            checkpoint_every=6,
            **train,
        ),
    )


# A member equals its run to float32 rounding, not bitwise: XLA:CPU compiles the batched
# program's reductions (the loss's mean, the gradients' sums over the batch) in another order,
# so losses first differ by one ulp at step 3 of 12, and the states by about as much after.
RTOL, ATOL = 1e-5, 1e-6


def _assert_same_tree(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_close_tree(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL)


def _assert_close_rows(a: list[dict], b: list[dict]):
    assert [(r["step"], r.get("split"), sorted(r)) for r in a] == [
        (r["step"], r.get("split"), sorted(r)) for r in b
    ]
    for x, y in zip(a, b, strict=True):
        for k, v in x.items():
            if k != "examples_per_sec" and isinstance(v, float):
                assert v == pytest.approx(y[k], rel=RTOL, abs=ATOL), (x["step"], k)


@pytest.mark.parametrize(
    ("preset", "build"), [("dlrm/tiny", build_dlrm), ("wukong/tiny", build_wukong)]
)
def test_each_member_equals_its_separate_run(tmp_path, preset, build):
    # Two members, as every population of this module (one compiled program for all of them).
    cfgs = [_cfg(preset, seed, lrs) for seed, lrs in zip((0, 1), LRS, strict=True)]
    dirs = [tmp_path / f"member{i}" for i in range(2)]
    results = train_population(cfgs, build, dirs)
    for i, cfg in enumerate(cfgs):
        alone = train(cfg, build, tmp_path / f"alone{i}")
        _assert_close_rows([results[i]], [alone])
        # every train and eval row
        _assert_close_rows(metric_rows(dirs[i]), metric_rows(tmp_path / f"alone{i}"))
        for step in (6, STEPS):
            _assert_close_tree(
                checkpoint_item(dirs[i], step), checkpoint_item(tmp_path / f"alone{i}", step)
            )
    assert results[0]["logloss"] != results[1]["logloss"]  # the seeds differ


def test_a_population_resumes_as_it_would_have_gone_on(tmp_path, monkeypatch):
    cfgs = [_cfg("dlrm/tiny", seed) for seed in (0, 1)]
    whole = train_population(cfgs, build_dlrm, [tmp_path / "w0", tmp_path / "w1"])
    dirs = [tmp_path / "r0", tmp_path / "r1"]
    with monkeypatch.context() as m:  # a SIGTERM during step 5: checkpoint after it, stop
        m.setattr(population.Preemption, "reached", lambda self, done: done == 5)
        stopped = train_population(cfgs, build_dlrm, dirs)
    assert stopped == [{"step": 5, "preempted": True}] * 2
    resumed = train_population(cfgs, build_dlrm, dirs)
    assert resumed == whole  # bitwise: the same program from the same state and data
    for i in range(2):
        _assert_same_tree(
            checkpoint_item(dirs[i], STEPS), checkpoint_item(tmp_path / f"w{i}", STEPS)
        )
        evals = [
            [r for r in metric_rows(d) if r["split"] == "eval"]
            for d in (dirs[i], tmp_path / f"w{i}")
        ]
        assert evals[0] == evals[1]  # at step 6 and at the end


def test_a_population_of_branches_equals_its_members_one_piece_runs(tmp_path):
    small, large = 10, STEPS
    stable = [branches.stable_config(_cfg("dlrm/tiny", s), [small, large]) for s in (0, 1)]
    stable_dirs = [tmp_path / "s0", tmp_path / "s1"]
    train_population(stable, build_dlrm, stable_dirs)
    cfgs = [
        branches.branch_config(_cfg("dlrm/tiny", s), small, d)
        for s, d in zip((0, 1), stable_dirs, strict=True)
    ]
    assert cfgs[0].train.init_step == 8
    got = train_population(cfgs, build_dlrm, [tmp_path / "b0", tmp_path / "b1"])
    for s in (0, 1):
        one = _cfg("dlrm/tiny", s)
        one = dataclasses.replace(one, train=dataclasses.replace(one.train, num_steps=small))
        _assert_close_rows([got[s]], [train(one, build_dlrm, tmp_path / f"one{s}")])
        record = json.loads((tmp_path / f"b{s}" / "branch.json").read_text())
        assert record["init_from"] == str(stable_dirs[s].absolute())


def test_members_must_differ_only_in_seeds_and_rates():
    a, b = _cfg("dlrm/tiny", 0), _cfg("dlrm/tiny", 1)
    check_members([a, b])
    longer = dataclasses.replace(b, train=dataclasses.replace(b.train, num_steps=STEPS + 1))
    with pytest.raises(config_lib.ConfigError, match="train.num_steps"):
        check_members([a, longer])
    tiered = dataclasses.replace(a, train=dataclasses.replace(a.train, noise_scale_every=2))
    with pytest.raises(config_lib.ConfigError, match="noise_scale_every"):
        check_members([tiered, tiered])


def test_a_diverging_member_stops_alone(tmp_path):
    ok = _cfg("dlrm/tiny", 0, nonfinite="raise")
    bad = _cfg("dlrm/tiny", 1, (1e12, 1e12), nonfinite="raise")  # rates that blow up
    got = train_population([ok, bad], build_dlrm, [tmp_path / "ok", tmp_path / "bad"])
    assert "non-finite training loss" in got[1]["diverged"]
    assert "diverged" not in got[0] and got[0]["step"] == STEPS
    alone = train(ok, build_dlrm, tmp_path / "alone")
    _assert_close_rows([got[0]], [alone])


def test_members_without_a_common_checkpoint_are_refused(tmp_path):
    cfgs = [_cfg("dlrm/tiny", seed) for seed in (0, 1)]
    train(cfgs[0], build_dlrm, tmp_path / "m0")  # member 0 alone, to the end
    with pytest.raises(config_lib.ConfigError, match="no step in common"):
        train_population(cfgs, build_dlrm, [tmp_path / "m0", tmp_path / "m1"])


# A failed read makes orbax abandon the other reads' coroutines, which complain when garbage
# collected: orbax's noise, as in test_checkpoint_integrity, not an error of this test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_common_step_raises_or_falls_back(tmp_path, monkeypatch):
    cfgs = [_cfg("dlrm/tiny", seed) for seed in (0, 1)]
    whole = train_population(cfgs, build_dlrm, [tmp_path / "w0", tmp_path / "w1"])
    dirs = [tmp_path / "r0", tmp_path / "r1"]
    with monkeypatch.context() as m:  # stopped after step 9: checkpoints 6 and 9
        m.setattr(population.Preemption, "reached", lambda self, done: done == 9)
        train_population(cfgs, build_dlrm, dirs)
    for f in (dirs[1] / "checkpoints" / "9" / "params").glob("**/d/*"):  # member 1's step 9
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointCorruptError, match="step 9"):
        train_population(cfgs, build_dlrm, dirs)
    fallback = [
        dataclasses.replace(c, train=dataclasses.replace(c.train, checkpoint_fallback=True))
        for c in cfgs
    ]
    assert train_population(fallback, build_dlrm, dirs) == whole  # from step 6, bitwise
