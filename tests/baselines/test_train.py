"""Every baseline end to end: trains through the loop on the 8-device mesh, evaluates from its
workdir with the same metrics, and runs through its command-line entry points."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import baselines.dcnv2.evaluate
import baselines.dcnv2.train
import baselines.finalmlp.evaluate
import baselines.finalmlp.train
import baselines.masknet.evaluate
import baselines.masknet.train
from recscale import config as config_lib
from recscale import families
from recscale.config import get_preset
from recscale.train.loop import train

FAMILIES = ("dcnv2", "finalmlp", "masknet")
ENTRY_POINTS = {  # family -> its train and evaluate modules (python -m baselines.FAMILY.train)
    "dcnv2": (baselines.dcnv2.train, baselines.dcnv2.evaluate),
    "finalmlp": (baselines.finalmlp.train, baselines.finalmlp.evaluate),
    "masknet": (baselines.masknet.train, baselines.masknet.evaluate),
}


def _tiny(family: str, variant: str):
    cfg = get_preset(f"{family}/tiny")
    if variant == "serial":  # MaskNet's other structure
        assert cfg.model.model_type == "parallel"
        model = dataclasses.replace(cfg.model, model_type="serial", dnn_hidden_units=(16, 8))
        cfg = dataclasses.replace(cfg, model=model)
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, num_steps=6, log_every=1, progress=False)
    )


def _rows(workdir, split="train"):
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


@pytest.fixture(
    scope="module",
    params=[("dcnv2", ""), ("finalmlp", ""), ("masknet", "parallel"), ("masknet", "serial")],
    ids=lambda p: "-".join(filter(None, p)),
)
def trained_tiny(request, tmp_path_factory):
    """FAMILY/tiny for a few steps, through recscale.train.loop.train."""
    family, variant = request.param
    cfg = _tiny(family, variant)
    wd = tmp_path_factory.mktemp(f"{family}{variant}") / "run"
    return family, wd, cfg, train(cfg, families.load(family).build_model, wd)


def test_tiny_trains_with_finite_loss(trained_tiny):
    _, wd, cfg, result = trained_tiny
    assert result["step"] == 6
    losses = [r["loss"] for r in _rows(wd)]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert np.isfinite(result["logloss"]) and 0.0 <= result["auc"] <= 1.0
    assert config_lib.load_json(type(cfg), wd / "config.json") == cfg


def test_evaluate_round_trip_from_workdir(trained_tiny, tmp_path, capsys):
    family, wd, _, final = trained_tiny
    capsys.readouterr()
    out_file = tmp_path / "eval.json"
    got = ENTRY_POINTS[family][1].main(["--workdir", str(wd), "--output", str(out_file)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == got == json.loads(out_file.read_text())
    for key in ("auc", "logloss", "ne", "calibration", "num_examples", "step"):
        assert got[key] == final[key], key


@pytest.mark.parametrize("family", FAMILIES)
def test_train_entry_point(family, tmp_path, capsys):
    wd = tmp_path / "cli"
    entry = ENTRY_POINTS[family][0]
    argv = [f"{family}/tiny", "--workdir", str(wd), "--train.num-steps", "2", "--train.no-progress"]
    result = entry.main(argv)
    assert result["step"] == 2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert f"baselines.{family}.train" in (wd / "command.txt").read_text()
    with pytest.raises(SystemExit, match="unknown preset"):
        entry.main(["nope", "--workdir", str(wd)])
