"""A sequential sweep end to end (``sweeps.specs.seq_tiny``): the real launcher trains HSTU and
the bag on the */tiny planted histories as plain trials, prices a pack as the train rows
count it, and the analysis fits the eval next-item loss against the generator's Bayes floor
and baselines."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from data.sequences.planted import PlantedSequences
from recscale import config as config_lib
from recscale import families
from sequential.recipes import TINY_PLANTED
from sequential.run_config import pack_stats, train_lengths
from sweeps import analyze, launch
from sweeps.spec import load_spec, resolve
from sweeps.specs import seq_planted
from sweeps.store import SweepStore, read_results

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("seq_tiny")
    assert launch.main(["sweeps.specs.seq_tiny", "--sweep-dir", str(root)]) == 0
    return root


def test_trials_run_and_report_the_eval_loss(sweep):
    res = resolve(load_spec("sweeps.specs.seq_tiny"))
    assert [(t.family, t.steps) for t in res.trials] == [("hstu", 10), ("hstu", 20), ("bag", 7)]
    assert res.skipped == ("bag budget 4e+07 rung d8: 3 steps < min_steps=5",)
    rows = {r["trial_id"]: r for r in read_results(sweep / "results.jsonl").rows}
    assert set(rows) == {t.trial_id for t in res.trials}
    gen = PlantedSequences(TINY_PLANTED, seed=0)
    bayes = gen.losses(gen.eval_histories(), gen.train_histories(0, 512))["bayes"]
    store = SweepStore(sweep)
    for t in res.trials:
        row = rows[t.trial_id]
        assert row["status"] == "SUCCESS" and row["data_fingerprint"].startswith("planted:")
        final = row["final"]
        assert final["step"] == t.steps and final["loss"] > final["bayes_loss"]
        assert final["bayes_loss"] == pytest.approx(bayes, rel=1e-12)
        assert row["best"]["loss"] == final["loss"]  # one evaluation: the final one
        # The sweep priced a pack at the first epoch's mean tokens and history length; the
        # train rows log what each step cost (every step here: log_every 1). Packs of ~116 of
        # at most 128 tokens: the means of 56-160 of them agree within a few percent.
        lines = (store.workdir(t.trial_id) / "metrics.jsonl").read_text().splitlines()
        train = [json.loads(x) for x in lines if '"split": "train"' in x]
        assert [r["step"] for r in train] == list(range(1, t.steps + 1))
        logged = sum(r["train_flops"] for r in train)
        assert logged == pytest.approx(t.compute, rel=0.03)


def test_analysis_fits_the_loss_beside_the_bayes_floor(sweep, capsys):
    out = analyze.main([str(sweep), "--no-plots", "--n-boot", "20"])
    printed = capsys.readouterr().out
    rows = read_results(sweep / "results.jsonl").rows
    bayes = rows[0]["final"]["bayes_loss"]
    assert out["metric"] == "loss" and out["bayes_reference"] == pytest.approx(bayes, rel=1e-12)
    base = out["planted_baselines"]
    assert base["bayes"] == out["bayes_reference"]
    assert base["taste_known"] < base["bayes"] < base["last_item"] < base["bag"] < base["unigram"]
    assert set(out["families"]) == {"hstu", "bag"}
    hstu = out["families"]["hstu"]
    got = {r["budget"]: r["y"] for r in hstu["frontier"]}
    want = {r["budget"]: r["final"]["loss"] for r in rows if r["family"] == "hstu"}
    assert got == pytest.approx(want)
    assert hstu["law_bayes_floor"]["floor_fixed"] and np.isclose(
        hstu["law_bayes_floor"]["c"], bayes
    )
    assert (
        f"Bayes-optimal eval next-item loss (nats) of the planted teacher on the eval set: {bayes:.4f}"
        in printed
    )
    assert "planted baselines on the eval set (nats): bayes" in printed
    saved = json.loads((sweep / "analysis.json").read_text())
    assert saved["planted_baselines"] == pytest.approx(base)


def test_the_scaling_arm_resolves_as_its_docstring_says():
    """``sweeps.specs.seq_planted``: three families, five budgets over two decades, every size
    whose run is 20-4,500 steps (four to seven a budget), three seeds; every trial reads fresh
    histories (no more tokens than the first epoch holds); its pilot's trials are among it."""
    res = resolve(load_spec("sweeps.specs.seq_planted"))
    spec = seq_planted.SPEC
    assert spec.budgets[-1] / spec.budgets[0] == pytest.approx(100.0) and len(spec.budgets) == 5
    cells = {(t.family, t.budget, t.rung) for t in res.trials}
    assert len(res.trials) == 3 * len(cells) and {t.seed for t in res.trials} == {0, 1, 2}
    for fam in ("hstu", "sasrec", "bag"):
        sizes = [sum(c[:2] == (fam, b) for c in cells) for b in spec.budgets]
        assert min(sizes) >= 4 and max(sizes) == 7, (fam, sizes)
    assert all(20 <= t.steps <= 4500 for t in res.trials)
    assert all(re.search(r"steps [<>] m(in|ax)_steps=", s) for s in res.skipped)
    for fam in ("hstu", "sasrec", "bag"):
        cfg = config_lib.from_dict(
            families.load(fam).config_cls, next(t for t in res.trials if t.family == fam).config
        )
        tokens, _ = pack_stats(cfg)
        held = int(train_lengths(cfg.data).sum())
        most = max(t.examples for t in res.trials if t.family == fam)
        assert most * tokens <= held, (fam, most * tokens, held)
    pilot = resolve(load_spec("sweeps.specs.seq_planted_pilot"))
    assert {t.budget for t in pilot.trials} == {spec.budgets[0], spec.budgets[-1]}
    assert {t.trial_id for t in pilot.trials} <= {t.trial_id for t in res.trials}
