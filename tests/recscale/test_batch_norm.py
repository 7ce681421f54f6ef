"""BatchNorm: torch semantics, running statistics as checkpointed model state, sync over a mesh."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlrm.presets  # noqa: F401
from dlrm import evaluate as dlrm_evaluate
from dlrm.model import build_model
from recscale.config import get_preset
from recscale.nn import MLP, BatchNorm
from recscale.train import checkpoint
from recscale.train.checkpoint import CheckpointCorruptError
from recscale.train.loop import train


def test_batch_norm_matches_torch_batchnorm1d_semantics():
    rng = np.random.default_rng(0)
    bn = BatchNorm(3, momentum=0.9, eps=1e-5)
    bn.scale[...] = jnp.asarray([1.0, 2.0, 0.5])
    bn.bias[...] = jnp.asarray([0.0, -1.0, 3.0])
    run_mean, run_var = np.zeros(3), np.ones(3)
    for _ in range(3):
        x = rng.normal(2.0, 3.0, size=(16, 3)).astype(np.float32)
        got = np.asarray(bn(jnp.asarray(x), train=True))
        mean, var = x.mean(0), x.var(0)  # biased variance normalises (torch)
        want = (x - mean) / np.sqrt(var + 1e-5) * [1.0, 2.0, 0.5] + [0.0, -1.0, 3.0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        # Running statistics: torch's momentum 0.1 is our 0.9, with the unbiased variance.
        run_mean = 0.9 * run_mean + 0.1 * mean
        run_var = 0.9 * run_var + 0.1 * x.var(0, ddof=1)
        np.testing.assert_allclose(np.asarray(bn.mean[...]), run_mean, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(bn.var[...]), run_var, rtol=1e-5)
    x = rng.normal(size=(5, 3)).astype(np.float32)
    got = np.asarray(bn(jnp.asarray(x), train=False))  # evaluation: running statistics, no update
    want = (x - run_mean) / np.sqrt(run_var + 1e-5) * [1.0, 2.0, 0.5] + [0.0, -1.0, 3.0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(bn.mean[...]), run_mean, rtol=1e-5)


def test_mlp_batch_norm_placement_and_state_kinds():
    mlp = MLP(4, (8, 6, 1), final_relu=False, batch_norm=True, rngs=nnx.Rngs(0))
    stats = nnx.state(mlp, nnx.BatchStat)
    assert [x.shape for x in jax.tree.leaves(stats)] == [
        (8,),
        (8,),
        (6,),
        (6,),
    ]  # hidden layers only
    deep = MLP(4, (8, 6), final_relu=True, batch_norm=True, rngs=nnx.Rngs(0))
    assert len(jax.tree.leaves(nnx.state(deep, nnx.BatchStat))) == 4  # both layers are ReLU layers
    x = jnp.ones((4, 4))
    key = jax.random.key(0)
    mlp(x, dropout_key=key)  # training mode updates the running mean
    assert not np.allclose(np.asarray(mlp.norms[0].mean[...]), 0.0)
    with pytest.raises(ValueError, match="layer_norm or batch_norm"):
        MLP(4, (8, 1), final_relu=False, layer_norm=True, batch_norm=True, rngs=nnx.Rngs(0))


def _bn_tiny(**train):
    cfg = get_preset("dlrm/tiny")
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, batch_norm=True),
        train=dataclasses.replace(cfg.train, progress=False, log_every=1, **train),
    )


def _rows(wd):
    return [
        r
        for r in map(json.loads, (Path(wd) / "metrics.jsonl").read_text().splitlines())
        if r["split"] == "train"
    ]


def test_dlrm_with_batch_norm_checkpoints_resumes_and_evaluates_its_statistics(
    tmp_path, capsys, monkeypatch
):
    cfg = _bn_tiny(num_steps=6, checkpoint_every=3, max_checkpoints=5)
    full = tmp_path / "full"
    final = train(cfg, build_model, full)
    assert (full / "checkpoints" / "6" / "batch_stats").is_dir()

    # Evaluation restores the running statistics: it reproduces the trainer's final metrics.
    got = dlrm_evaluate.main(["--workdir", str(full)])
    for key in ("auc", "logloss", "num_examples"):
        assert got[key] == final[key], key

    # Resume from step 3 is bitwise the uninterrupted run (statistics included).
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    rows = [r for r in _rows(resumed) if r["step"] <= 3]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    again = train(cfg, build_model, resumed)
    assert "restored checkpoint step 3" in capsys.readouterr().err
    assert [r["loss"] for r in _rows(resumed)] == [r["loss"] for r in _rows(full)]
    assert again["logloss"] == final["logloss"]

    # Without the statistics (fresh running mean 0 / var 1) evaluation is a different model.
    stale = tmp_path / "stale"
    shutil.copytree(full, stale)
    fresh = train(_bn_tiny(num_steps=0), build_model, tmp_path / "fresh")
    shutil.rmtree(stale / "checkpoints" / "6" / "batch_stats")
    shutil.copytree(
        tmp_path / "fresh" / "checkpoints" / "0" / "batch_stats",
        stale / "checkpoints" / "6" / "batch_stats",
    )
    assert fresh["step"] == 0
    # A transplanted item fails the checkpoint's fingerprints...
    with pytest.raises(CheckpointCorruptError, match="batch_stats leaf"):
        dlrm_evaluate.main(["--workdir", str(stale)])
    # ...so read it with the check off, to see the statistics matter.
    monkeypatch.setattr(checkpoint, "fingerprints", lambda trees: {})
    assert dlrm_evaluate.main(["--workdir", str(stale)])["logloss"] != final["logloss"]


def test_batch_norm_is_synchronised_over_the_mesh(tmp_path):
    # Batch statistics over the global batch: 1 and 8 data-parallel devices train the same model.
    losses = {}
    for n in (1, 8):
        cfg = _bn_tiny(num_steps=5)
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data_parallel=n))
        train(cfg, build_model, tmp_path / f"d{n}")
        losses[n] = [r["loss"] for r in _rows(tmp_path / f"d{n}")]
    np.testing.assert_allclose(losses[1], losses[8], rtol=1e-5)
