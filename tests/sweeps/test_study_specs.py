"""The scaling study's specs (``sweeps/specs/study*.py``) against what is committed under ``docs/``.

Resolving a spec needs no jax and no data, so this runs in a second: it guards the promise that a
relaunch of any of them skips the trials whose results are committed (the trial ids the spec
resolves to are the ones ``docs/<study>/sweep.json`` records), and the study's design as issue 15
set it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sweeps import spec as spec_lib

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _check_committed(name):
    res = spec_lib.resolve(spec_lib.load_spec(f"sweeps.specs.{name}"))
    committed = json.loads((DOCS / name / "sweep.json").read_text())["trial_ids"]
    assert [t.trial_id for t in res.trials] == committed


@pytest.mark.parametrize("name", ["study", "study_lr", "study_grid", "study_check"])
def test_spec_resolves_to_the_committed_trials(name):
    _check_committed(name)


def test_frappe_arm_resolves_to_the_committed_trials(frappe_dir, monkeypatch):
    # Its trial ids hash the data files (``spec.data_fingerprint``), read where the presets
    # point: ../shared/data/frappe from the repository root.
    monkeypatch.chdir(DOCS.parent)
    _check_committed("study_frappe")


def test_the_study_spans_three_decades_with_seeded_isoflop_grids():
    sp = spec_lib.load_spec("sweeps.specs.study")
    res = spec_lib.resolve(sp)
    budgets = np.array(sp.budgets)
    assert len(budgets) >= 7 and budgets.max() / budgets.min() >= 1e3
    assert len(sp.seeds) >= 3
    for fam in sp.families:
        assert len(fam.ladder) >= 6
        dims = [r.model.get("embed_dim") for r in fam.ladder]
        assert dims == sorted(dims) and dims[-1] > dims[0], (fam.family, dims)  # d grows too
        trials = [t for t in res.trials if t.family == fam.family]
        for b in budgets:
            sizes = {t.rung for t in trials if t.budget == b}
            assert len(sizes) >= 4, (fam.family, b, sizes)
