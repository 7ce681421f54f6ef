"""Fault tolerance by fault injection: SIGTERM mid-run, non-finite steps (skipped bitwise, on
the dense path and the sparse engine path), rollback, and same-seed runs being bitwise equal."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import dlrm.presets  # noqa: F401
import wukong.presets  # noqa: F401
from data.batch import Batch
from dlrm.model import build_model as dlrm_build_model
from recscale import sharding
from recscale.config import EmbeddingShardingConfig, get_preset
from recscale.train import task as task_lib
from recscale.train.experiment import Experiment
from recscale.train.loop import train
from recscale.train.steps import make_train_step
from tests.run_files import checkpoint_item, metric_rows
from wukong.model import build_model as wukong_build_model

REPO = Path(__file__).resolve().parents[2]
BUILD = {"dlrm": dlrm_build_model, "wukong": wukong_build_model}


def _cfg(family="dlrm", emb="off", opt="rowwise_adagrad", **train_overrides):
    cfg = get_preset(f"{family}/tiny")
    train_overrides = {"progress": False, "log_every": 1, **train_overrides}
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, **train_overrides),
        embeddings=EmbeddingShardingConfig(sharding=emb),
        embedding_optim=dataclasses.replace(cfg.embedding_optim, name=opt),
    )


def _assert_trees_equal(a, b, *, nonempty=True):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and (la or not nonempty)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _trees_equal(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _nan_dense(b: Batch) -> Batch:
    dense = np.array(b.dense_bn, copy=True)
    dense[1, 0] = np.nan
    return b._replace(dense_bn=dense)


def _inf_labels(b: Batch) -> Batch:
    # An infinite label: the loss's gradient with respect to the logits is infinite.
    labels = np.array(b.labels_b, copy=True)
    labels[0] = np.inf
    return b._replace(labels_b=labels)


CORRUPT = {"nan_dense": _nan_dense, "inf_labels": _inf_labels}

# ------------------------------------------------------------------------------------------------
# One step: a non-finite step leaves the state bitwise unchanged.


def _step_run(cfg, corrupt, nonfinite="skip"):
    """Steps on batches 0 (good), 1 (corrupted), 2 (good); host copies of the state before and
    after each step, and each step's metrics."""
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        exp = Experiment.build(cfg, BUILD["dlrm"])
        step = jax.jit(
            make_train_step(exp.graphdef, exp.tx, nonfinite=nonfinite),
            in_shardings=(exp.state_sharding, None),
            out_shardings=(exp.state_sharding, None),
            donate_argnums=(0,),
        )
        state = exp.init_state()
        states, metrics = [jax.device_get(state)], []
        for i in range(3):
            b = exp.source.train_batch(i)
            state, m = step(state, exp.device_batch(corrupt(b) if i == 1 else b))
            states.append(jax.device_get(state))  # a copy: the next step donates ``state``
            metrics.append(jax.device_get(m))
    return states, metrics


@pytest.mark.parametrize(
    "emb,opt,corrupt",
    [
        ("off", "rowwise_adagrad", "nan_dense"),
        pytest.param("off", "rowwise_adagrad", "inf_labels", marks=pytest.mark.slow),
        pytest.param("row_wise", "rowwise_adagrad", "nan_dense", marks=pytest.mark.slow),
        pytest.param("row_wise", "rowwise_adagrad", "inf_labels", marks=pytest.mark.slow),
        pytest.param("row_wise", "sgd", "inf_labels", marks=pytest.mark.slow),
        ("row_wise", "adam", "inf_labels"),
    ],
)
def test_a_nonfinite_step_leaves_the_state_bitwise_unchanged(emb, opt, corrupt):
    cfg = _cfg(emb=emb, opt=opt)
    states, metrics = _step_run(cfg, CORRUPT[corrupt])
    before, after = states[1], states[2]
    assert [float(m["nonfinite"]) for m in metrics] == [0.0, 1.0, 0.0]
    assert not np.isfinite(metrics[1]["loss"])
    assert int(after.step) == int(before.step) + 1  # the data position moves on
    # Parameters (tables included), optimizer state (row-wise Adagrad accumulators, lazy Adam's
    # moments, the dense Adam's count) and BatchNorm statistics: bitwise those of step 1.
    _assert_trees_equal(before.params, after.params)
    _assert_trees_equal(before.opt_state, after.opt_state)
    _assert_trees_equal(before.batch_stats, after.batch_stats, nonempty=False)  # DLRM: none
    # Training goes on, finite, and the good steps do change the state.
    assert np.isfinite(metrics[2]["loss"])
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(states[3].params))
    assert not _trees_equal(states[2].params, states[3].params)
    assert not _trees_equal(states[0].params, states[1].params)


@pytest.mark.parametrize("emb", ["off", pytest.param("row_wise", marks=pytest.mark.slow)])
def test_ignore_applies_the_nonfinite_step(emb):
    # The control: without the guard the same step does corrupt the state, so the bitwise
    # equality above is what the guard buys.
    states, metrics = _step_run(_cfg(emb=emb, opt="adam"), _inf_labels, nonfinite="ignore")
    assert float(metrics[1]["nonfinite"]) == 1.0
    assert not _trees_equal(states[1].params, states[2].params)
    assert not _trees_equal(states[1].opt_state, states[2].opt_state)


# ------------------------------------------------------------------------------------------------
# The loop: counting, raising, rolling back.


@pytest.fixture
def bad_batches(monkeypatch):
    """``bad_batches(steps)``: training batches at those step indices get a NaN dense value."""
    bad: set[int] = set()
    make_source = task_lib.make_source  # the CTR task's (recscale.train.task.CTRTask)

    class Corrupting:
        def __init__(self, source):
            self._source = source

        def __getattr__(self, name):
            return getattr(self._source, name)

        def train_batch(self, step):
            b = self._source.train_batch(step)
            return _nan_dense(b) if step in bad else b

    monkeypatch.setattr(task_lib, "make_source", lambda *a, **k: Corrupting(make_source(*a, **k)))
    return bad.update


def test_skipped_steps_are_counted_and_training_goes_on(tmp_path, bad_batches):
    bad_batches({2, 3})
    wd = tmp_path / "run"
    result = train(_cfg(num_steps=6, log_every=2), dlrm_build_model, wd)
    rows = metric_rows(wd)
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert [r["nonfinite_steps"] for r in rows] == [0, 2, 0]
    assert [r["nonfinite_total"] for r in rows] == [0, 2, 2]
    assert "loss" not in rows[1]  # no applied step to average
    assert np.isfinite(rows[2]["loss"]) and np.isfinite(result["logloss"])


@pytest.mark.slow
def test_raise_stops_at_the_first_nonfinite_step(tmp_path, bad_batches):
    bad_batches({2})
    with pytest.raises(FloatingPointError, match=r"non-finite training loss nan at step 3 "):
        train(_cfg(num_steps=6, log_every=3, nonfinite="raise"), dlrm_build_model, tmp_path)


@pytest.mark.slow
def test_too_many_nonfinite_steps_in_a_row_is_a_divergence(tmp_path, bad_batches):
    bad_batches({1, 2, 3})
    cfg = _cfg(num_steps=6, log_every=6, nonfinite_max_consecutive=3)
    with pytest.raises(FloatingPointError, match=r"at step 4: 3 non-finite steps in a row"):
        train(cfg, dlrm_build_model, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("emb", ["off", "row_wise"])
def test_rollback_after_k_nonfinite_steps_restores_the_last_good_checkpoint(
    tmp_path, bad_batches, emb, capsys
):
    bad_batches({4, 5})
    cfg = _cfg(
        emb=emb,
        num_steps=8,
        log_every=4,
        checkpoint_every=3,
        max_checkpoints=5,
        nonfinite_rollback=2,
    )
    wd = tmp_path / "run"
    train(cfg, dlrm_build_model, wd)
    (rb,) = metric_rows(wd, "rollback")
    # Steps 5 and 6 (batches 4, 5) were bad; checkpoint 3 is the last from before them; the
    # batches 3..5 since it are skipped and training goes on at step 6 from checkpoint 3's state.
    assert rb == {
        "step": 6,
        "split": "rollback",
        "restored_step": 3,
        "nonfinite_steps": [5, 6],
        "skipped_batches": [3, 6],
    }
    assert "restored checkpoint step 3, skipping batches [3, 6)" in capsys.readouterr().err
    _assert_trees_equal(checkpoint_item(wd, 3), checkpoint_item(wd, 6))
    rows = metric_rows(wd)
    assert [r["step"] for r in rows] == [4, 8]
    assert all(np.isfinite(r["loss"]) for r in rows)
    # Without the rollback the state at step 6 is the one after batches 3 and 4 (not 3's).
    plain = tmp_path / "plain"
    train(
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, nonfinite_rollback=0)),
        dlrm_build_model,
        plain,
    )
    assert not _trees_equal(checkpoint_item(plain, 6), checkpoint_item(wd, 6))


@pytest.mark.slow
def test_rollback_needs_a_checkpoint_before_the_bad_steps(tmp_path, bad_batches):
    bad_batches({1, 2})
    cfg = _cfg(num_steps=6, checkpoint_every=4, nonfinite_rollback=2)
    with pytest.raises(FloatingPointError, match="no checkpoint at or before step 1"):
        train(cfg, dlrm_build_model, tmp_path)


def test_config_checks():
    with pytest.raises(ValueError, match="nonfinite='boom'"):
        _cfg(nonfinite="boom")
    with pytest.raises(ValueError, match="needs nonfinite='skip'"):
        _cfg(nonfinite="raise", nonfinite_rollback=2)
    with pytest.raises(ValueError, match="must exceed nonfinite_rollback"):
        _cfg(nonfinite_rollback=3, nonfinite_max_consecutive=3)


# ------------------------------------------------------------------------------------------------
# Determinism: fresh runs with one seed are bitwise equal; another seed differs.


# Each model once and each embedding path once (the other two pairings cost CI a minute and
# exercise no code these do not).
@pytest.mark.parametrize(
    "family,emb",
    [
        pytest.param("dlrm", "row_wise", marks=pytest.mark.slow),
        pytest.param("wukong", "off", marks=pytest.mark.slow),
    ],
)
def test_same_seed_is_bitwise_equal_and_another_seed_differs(tmp_path, family, emb):
    out = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        wd = tmp_path / name
        train(_cfg(family, emb=emb, num_steps=3, seed=seed), BUILD[family], wd)
        out[name] = ([r["loss"] for r in metric_rows(wd)], checkpoint_item(wd, 3))
    assert len(out["a"][0]) == 3
    assert out["a"][0] == out["b"][0]  # every logged loss, bitwise
    _assert_trees_equal(out["a"][1], out["b"][1])
    assert all(x != y for x, y in zip(out["a"][0], out["c"][0], strict=True))
    assert not _trees_equal(out["a"][1], out["c"][1])


# ------------------------------------------------------------------------------------------------
# Preemption: SIGTERM mid-run.


def _train_cmd(workdir, steps):
    return [
        sys.executable,
        "-m",
        "dlrm.train",
        "dlrm/tiny",
        "--workdir",
        str(workdir),
        "--train.num-steps",
        str(steps),
        "--train.no-progress",
        "--train.log-every",
        "1",
    ]


@pytest.mark.slow
def test_sigterm_checkpoints_exits_zero_and_the_relaunch_equals_uninterrupted(tmp_path):
    # The signal goes out when the first metrics line appears and lands within a step or two;
    # 600 tiny steps at one log line each (~4 s) leave it a wide margin, and a run that
    # finished first fails below rather than passing.
    steps = 600
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = dict(cwd=REPO, env=env, capture_output=True, text=True)
    wd = tmp_path / "preempted"
    proc = subprocess.Popen(
        _train_cmd(wd, steps),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = wd / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "no metrics line"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stopped = metric_rows(wd)[-1]["step"]
    assert 0 < stopped < steps, "the run finished before the signal: make it longer"
    assert f"SIGTERM: saved checkpoint step {stopped}" in err
    assert json.loads(out.strip().splitlines()[-1]) == {"step": stopped, "preempted": True}
    assert (wd / "checkpoints" / str(stopped) / "params").is_dir()

    relaunch = subprocess.run(_train_cmd(wd, steps), **run)
    assert relaunch.returncode == 0, relaunch.stderr
    assert f"restored checkpoint step {stopped}" in relaunch.stderr
    full = tmp_path / "full"
    subprocess.run(_train_cmd(full, steps), check=True, **run)
    resumed_rows, full_rows = metric_rows(wd), metric_rows(full)
    assert [r["step"] for r in resumed_rows] == list(range(1, steps + 1))  # no step twice
    assert [r["loss"] for r in resumed_rows] == [r["loss"] for r in full_rows]  # bitwise
    _assert_trees_equal(checkpoint_item(full, steps), checkpoint_item(wd, steps))
