"""MaskNet end to end: both structures train through the loop, evaluate from their workdir, CLI
entry points."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import baselines.masknet.presets  # noqa: F401
from baselines.masknet import evaluate as masknet_evaluate
from baselines.masknet import train as masknet_train
from baselines.masknet.config import MaskNetConfig
from baselines.masknet.model import build_model
from recscale import config as config_lib
from recscale.config import get_preset
from recscale.train.loop import train


def _rows(workdir, split="train"):
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def _tiny(model_type: str) -> MaskNetConfig:
    cfg = get_preset("masknet/tiny")
    assert cfg.model.model_type == "parallel"
    if model_type == "serial":
        model = dataclasses.replace(cfg.model, model_type="serial", dnn_hidden_units=(16, 8))
        cfg = dataclasses.replace(cfg, model=model)
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, num_steps=6, log_every=1, progress=False)
    )


@pytest.fixture(scope="module", params=["parallel", "serial"])
def trained_tiny(request, tmp_path_factory):
    """masknet/tiny (and its serial variant) for a few steps on the 8-device mesh, through
    recscale.train.loop.train."""
    cfg = _tiny(request.param)
    wd = tmp_path_factory.mktemp(f"masknet_{request.param}") / "run"
    return wd, cfg, train(cfg, build_model, wd)


def test_tiny_trains_with_finite_loss(trained_tiny):
    wd, cfg, result = trained_tiny
    assert result["step"] == 6
    losses = [r["loss"] for r in _rows(wd)]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert np.isfinite(result["logloss"]) and 0.0 <= result["auc"] <= 1.0
    assert config_lib.load_json(MaskNetConfig, wd / "config.json") == cfg


def test_evaluate_round_trip_from_workdir(trained_tiny, tmp_path, capsys):
    wd, _, final = trained_tiny
    capsys.readouterr()
    out_file = tmp_path / "eval.json"
    got = masknet_evaluate.main(["--workdir", str(wd), "--output", str(out_file)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == got == json.loads(out_file.read_text())
    for key in ("auc", "logloss", "ne", "calibration", "num_examples", "step"):
        assert got[key] == final[key], key


def test_train_entry_point(tmp_path, capsys):
    wd = tmp_path / "cli"
    argv = ["masknet/tiny", "--workdir", str(wd), "--train.num-steps", "2", "--train.no-progress"]
    argv += ["--model.model-type", "serial", "--model.dnn-hidden-units", "8", "4"]
    result = masknet_train.main(argv)
    assert result["step"] == 2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    command = (wd / "command.txt").read_text()
    assert "baselines.masknet.train" in command
    saved = config_lib.load_json(MaskNetConfig, wd / "config.json")
    assert (saved.model.model_type, saved.model.dnn_hidden_units) == ("serial", (8, 4))
    with pytest.raises(SystemExit, match="unknown preset"):
        masknet_train.main(["nope", "--workdir", str(wd)])
