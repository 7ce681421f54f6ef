"""The planner's measured inputs (``recscale.embeddings.plan_inputs``): the Zipf fit recovers
the synthetic generator's exponent, the trainer records the measured skew and the lookup
calibration in config.json and the checkpoints' layout, and a resume keeps them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import dlrm.presets  # noqa: F401
from data.config import DataConfig, SyntheticConfig
from dlrm.config import DLRMConfig
from dlrm.model import build_model
from recscale import config as config_lib
from recscale.config import get_preset
from recscale.embeddings import plan_inputs, relayout
from recscale.train.checkpoint import Checkpointer
from recscale.train.loop import train

# Over 5 data seeds (shuffle_seed 0-4, 16 batches of 1,024) the fits read, for s = 1.1:
# 1.101 / 1.105 / 1.105 (sd 0.006 / 0.003 / 0.005) on the 100 / 1,000 / 100,000-row tables;
# for s = 0.8 and 1.5 within 0.011 of s; for uniform ids at most 0.02. The largest bias seen
# (+0.011) plus three standard deviations (0.018) is under TOL.
TOL = 0.03
VOCAB, HOTNESS = (100, 1000, 100_000), (1, 4, 2)


def _data(s: float) -> DataConfig:
    syn = SyntheticConfig(num_dense=1, vocab_sizes=VOCAB, max_hotness=HOTNESS, zipf_exponent=s)
    return DataConfig(batch_size=1024, synthetic=syn)


@pytest.mark.parametrize("s", [1.1, 0.0])
def test_the_fit_recovers_the_synthetic_generators_exponent(s):
    fits = plan_inputs.measure_skew(_data(s), 16)
    assert sorted(fits) == ["f0", "f1", "f2"]
    for name, fit in fits.items():
        assert abs(fit.exponent - s) < TOL, (name, fit)
        if s > 0:  # a head of ranks to fit, and a standard error that says how well
            assert fit.head >= plan_inputs.MIN_RANKS and 0 < fit.stderr < TOL / 3, (name, fit)
    # uniform over 100,000 rows: no row is seen MIN_COUNT times, nothing to fit
    assert s > 0 or fits["f2"].head < plan_inputs.MIN_RANKS


def test_ranking_and_counting_the_same_ids_would_read_skew_into_uniform_data():
    """The reason for the cross-fit: on uniform ids the sorted counts of one sample fall with
    rank, and fitting them reads a skew that is not there."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, 16_000)
    naive = plan_inputs.fit_zipf(ids, ids).exponent
    cross = plan_inputs.fit_zipf(ids[::2], ids[1::2]).exponent
    assert naive > 0.1 and cross < TOL, (naive, cross)
    assert plan_inputs.fit_zipf(ids[:50], ids[50:100]) == plan_inputs.ZipfFit(0.0, 0.0, 0)


def _tiny(**emb) -> DLRMConfig:
    cfg = get_preset("dlrm/tiny")
    return dataclasses.replace(
        cfg,
        embeddings=dataclasses.replace(cfg.embeddings, **emb),
        train=dataclasses.replace(
            cfg.train,
            num_steps=2,
            checkpoint_every=2,
            log_every=1,
            progress=False,
            async_checkpoint=False,
        ),
    )


def test_resolve_fills_in_what_is_asked_and_keeps_what_is_given():
    cfg = plan_inputs.resolve(_tiny(measure_skew=64, zipf_exponents=("f1=0.5",), calibrate=True))
    e = cfg.embeddings
    skew = dict(item.split("=") for item in e.zipf_exponents)
    assert sorted(skew) == ["f0", "f1", "f2", "f3"] and skew["f1"] == "0.5"  # given, kept
    assert all(float(v) > 0.5 for k, v in skew.items() if k != "f1")  # dlrm/tiny: s = 1.1
    assert e.cost_lookup_factor > 0 and e.profile == "cpu-2core"  # relative to this profile
    again = plan_inputs.resolve(cfg)  # everything asked for is there: nothing measured again
    assert again == cfg
    assert plan_inputs.resolve(_tiny()) == _tiny()  # nothing asked
    skew_only = plan_inputs.resolve(_tiny(measure_skew=64, calibrate=True), calibrate=False)
    assert skew_only.embeddings.cost_lookup_factor == 0 and skew_only.embeddings.zipf_exponents


def test_the_trainer_records_the_measurements_and_a_resume_keeps_them(
    tmp_path, capsys, monkeypatch
):
    cfg = _tiny(measure_skew=64, calibrate=True)
    train(cfg, build_model, tmp_path)
    err = capsys.readouterr().err
    assert "embeddings.measure_skew: Zipf exponents over 64 batches: f0 " in err
    assert "embeddings.calibrate: embedding_bag (auto) on cpu" in err and "lookup factor" in err
    saved = config_lib.load_json(DLRMConfig, tmp_path / "config.json").embeddings
    assert len(saved.zipf_exponents) == 4 and saved.cost_lookup_factor > 0
    # the checkpoint's layout records them, and config.json plans as it was saved under
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
    layout = ckpt.read_meta(2)["layout"]
    ckpt.close()
    meta = layout["engine"]
    assert meta["zipf_exponents"] == list(saved.zipf_exponents)
    assert meta["lookup_factor"] == saved.cost_lookup_factor and meta["profile"] == "cpu-2core"
    saved_cfg = config_lib.load_json(DLRMConfig, tmp_path / "config.json")
    assert not relayout.needs_relayout(layout, saved_cfg)
    assert (
        "predicted embedding step time per device" in (tmp_path / "embedding_plan.txt").read_text()
    )

    def refuse(*args, **kwargs):
        raise AssertionError("measured again on resume")

    monkeypatch.setattr(plan_inputs, "measure_skew", refuse)
    monkeypatch.setattr(plan_inputs, "calibrate_lookups", refuse)
    with pytest.raises(AssertionError, match="measured again"):  # a new run measures
        plan_inputs.resolve(cfg, tmp_path / "new")
    # what the trainer does first on a resume of the same command
    assert plan_inputs.resolve(cfg, tmp_path).embeddings == saved
