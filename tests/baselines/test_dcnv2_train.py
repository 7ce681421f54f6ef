"""DCNv2 end to end: trains through the loop, evaluates from its workdir, CLI entry points."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import baselines.dcnv2.presets  # noqa: F401
from baselines.dcnv2 import evaluate as dcnv2_evaluate
from baselines.dcnv2 import train as dcnv2_train
from baselines.dcnv2.config import DCNv2Config
from baselines.dcnv2.model import build_model
from recscale import config as config_lib
from recscale.config import get_preset
from recscale.train.loop import train


def _rows(workdir, split="train"):
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    """dcnv2/tiny for a few steps on the 8-device mesh, through recscale.train.loop.train."""
    cfg = get_preset("dcnv2/tiny")
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, num_steps=6, log_every=1, progress=False)
    )
    wd = tmp_path_factory.mktemp("dcnv2") / "run"
    return wd, cfg, train(cfg, build_model, wd)


def test_tiny_trains_with_finite_loss(trained_tiny):
    wd, cfg, result = trained_tiny
    assert result["step"] == 6
    losses = [r["loss"] for r in _rows(wd)]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert np.isfinite(result["logloss"]) and 0.0 <= result["auc"] <= 1.0
    assert config_lib.load_json(DCNv2Config, wd / "config.json") == cfg


def test_evaluate_round_trip_from_workdir(trained_tiny, tmp_path, capsys):
    wd, _, final = trained_tiny
    capsys.readouterr()
    out_file = tmp_path / "eval.json"
    got = dcnv2_evaluate.main(["--workdir", str(wd), "--output", str(out_file)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == got == json.loads(out_file.read_text())
    for key in ("auc", "logloss", "ne", "calibration", "num_examples", "step"):
        assert got[key] == final[key], key


def test_train_entry_point(tmp_path, capsys):
    wd = tmp_path / "cli"
    argv = ["dcnv2/tiny", "--workdir", str(wd), "--train.num-steps", "2", "--train.no-progress"]
    result = dcnv2_train.main(argv)
    assert result["step"] == 2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    command = (wd / "command.txt").read_text()
    assert "baselines.dcnv2.train" in command
    with pytest.raises(SystemExit, match="unknown preset"):
        dcnv2_train.main(["nope", "--workdir", str(wd)])
