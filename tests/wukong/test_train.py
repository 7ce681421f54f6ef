"""Wukong end to end: trains, learns, evaluates from its workdir, 1 device equals 8."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import wukong.presets  # noqa: F401
from recscale import config as config_lib
from recscale.config import get_preset
from recscale.train.loop import train
from tests.run_files import checkpoint_item, metric_rows, trained_parameters
from wukong import evaluate as wukong_evaluate
from wukong import train as wukong_train
from wukong.config import WukongConfig
from wukong.model import build_model


def _tiny(**train_overrides) -> WukongConfig:
    cfg = get_preset("wukong/tiny")
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, progress=False, **train_overrides)
    )


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    """wukong/tiny for 150 steps on the 8-device mesh, through the command-line entry point."""
    wd = tmp_path_factory.mktemp("wukong") / "run"
    argv = ["tiny", "--workdir", str(wd), "--train.num-steps", "150", "--train.log-every", "1"]
    argv += ["--train.checkpoint-every", "75", "--train.no-progress"]
    return wd, wukong_train.main(argv)


def test_tiny_trains_and_learns(trained_tiny, capsys):
    wd, result = trained_tiny
    assert result["step"] == 150
    assert result["auc"] > 0.6, result
    losses = [r["loss"] for r in metric_rows(wd)]
    assert len(losses) == 150 and all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < np.mean(losses[:10])
    cfg = config_lib.load_json(WukongConfig, wd / "config.json")
    assert cfg == _tiny(num_steps=150, log_every=1, checkpoint_every=75)
    assert (wd / "checkpoints" / "75").is_dir() and (wd / "checkpoints" / "150").is_dir()


def test_evaluate_round_trip_from_workdir(trained_tiny, tmp_path, capsys):
    wd, final = trained_tiny
    capsys.readouterr()
    out_file = tmp_path / "eval.json"
    got = wukong_evaluate.main(["--workdir", str(wd), "--output", str(out_file)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == got == json.loads(out_file.read_text())
    for key in ("auc", "logloss", "ne", "calibration", "num_examples", "step"):
        assert got[key] == final[key], key
    earlier = wukong_evaluate.main(["--workdir", str(wd), "--step", "75"])
    assert earlier["step"] == 75 and earlier["auc"] != got["auc"]


def test_one_device_equals_eight(trained_tiny, tmp_path):
    # The 8-device run is the fixture's; tiny's learning rates are constant, so its first 75
    # steps are exactly a 75-step run's.
    wd8, _ = trained_tiny
    cfg = _tiny(num_steps=75, log_every=1)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data_parallel=1))
    wd1 = tmp_path / "d1"
    train(cfg, build_model, wd1)
    losses1 = [r["loss"] for r in metric_rows(wd1)]
    losses8 = [r["loss"] for r in metric_rows(wd8)][:75]
    np.testing.assert_allclose(losses1[:10], losses8[:10], rtol=1e-5)
    np.testing.assert_allclose(losses1, losses8, rtol=1e-4)
    # the engine's plans differ on 1 and 8 devices: tables compared whole, on one device
    a = trained_parameters(WukongConfig, build_model, wd1, 75)
    b = trained_parameters(WukongConfig, build_model, wd8, 75)
    assert a.keys() == b.keys() and any(k.startswith("table/") for k in a)
    for k, x in a.items():
        np.testing.assert_allclose(b[k], x, rtol=1e-4, atol=1e-5, err_msg=k)


def _flat(tree):
    return {
        jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }


@pytest.mark.parametrize("projection", ["learned", "attentive"])
def test_static_and_attentive_projection_both_train(tmp_path, projection):
    cfg = _tiny(num_steps=60, log_every=1, checkpoint_every=0)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, fmb_projection=projection, batch_norm=True)
    )
    init = train(
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_steps=0)),
        build_model,
        tmp_path / "init",
    )
    result = train(cfg, build_model, tmp_path / "run")
    losses = [r["loss"] for r in metric_rows(tmp_path / "run")]
    assert len(losses) == 60 and all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < np.mean(losses[:10])
    assert result["logloss"] < init["logloss"]
    before, after = (
        _flat(checkpoint_item(tmp_path / "init", 0)),
        _flat(checkpoint_item(tmp_path / "run", 60)),
    )
    # The projection's own parameters (Y, or the MLP that computes it) moved in every layer.
    names = [
        k for k in before if ("projection" in k if projection == "learned" else "attention" in k)
    ]
    assert names and all(not np.array_equal(before[k], after[k]) for k in names), names
