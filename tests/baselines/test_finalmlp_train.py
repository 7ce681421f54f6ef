"""FinalMLP end to end: trains through the loop, evaluates from its workdir, CLI entry points."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import baselines.finalmlp.presets  # noqa: F401
from baselines.finalmlp import evaluate as finalmlp_evaluate
from baselines.finalmlp import train as finalmlp_train
from baselines.finalmlp.config import FinalMLPConfig
from baselines.finalmlp.model import build_model
from recscale import config as config_lib
from recscale.config import get_preset
from recscale.train.loop import train


def _rows(workdir, split="train"):
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    """finalmlp/tiny for a few steps on the 8-device mesh, through recscale.train.loop.train."""
    cfg = get_preset("finalmlp/tiny")
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, num_steps=6, log_every=1, progress=False)
    )
    wd = tmp_path_factory.mktemp("finalmlp") / "run"
    return wd, cfg, train(cfg, build_model, wd)


def test_tiny_trains_with_finite_loss(trained_tiny):
    wd, cfg, result = trained_tiny
    assert result["step"] == 6
    losses = [r["loss"] for r in _rows(wd)]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert np.isfinite(result["logloss"]) and 0.0 <= result["auc"] <= 1.0
    assert config_lib.load_json(FinalMLPConfig, wd / "config.json") == cfg


def test_evaluate_round_trip_from_workdir(trained_tiny, tmp_path, capsys):
    wd, _, final = trained_tiny
    capsys.readouterr()
    out_file = tmp_path / "eval.json"
    got = finalmlp_evaluate.main(["--workdir", str(wd), "--output", str(out_file)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == got == json.loads(out_file.read_text())
    for key in ("auc", "logloss", "ne", "calibration", "num_examples", "step"):
        assert got[key] == final[key], key


def test_train_entry_point(tmp_path, capsys):
    wd = tmp_path / "cli"
    argv = ["finalmlp/tiny", "--workdir", str(wd), "--train.num-steps", "2", "--train.no-progress"]
    result = finalmlp_train.main(argv)
    assert result["step"] == 2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    command = (wd / "command.txt").read_text()
    assert "baselines.finalmlp.train" in command
    with pytest.raises(SystemExit, match="unknown preset"):
        finalmlp_train.main(["nope", "--workdir", str(wd)])
