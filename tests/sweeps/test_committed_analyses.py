"""Every analysis committed under ``docs/`` regenerates from its committed results under the rule
of ``sweeps.reproduce``: bit for bit where it was made, within stated tolerances elsewhere, with
the same discrete answers. A change to the analysis code that moves a committed number beyond
the tolerance fails here."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sweeps import analyze, provenance, reproduce, surface

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
COMMITTED = sorted(p.parent.name for p in DOCS.glob("*/analysis.json"))
REGENERABLE = [n for n in COMMITTED if (DOCS / n / "results.jsonl").exists()]
OLDER = ["showcase"]
"""Committed without results.jsonl, by analysis code that wrote fewer keys than today's."""


def test_every_committed_analysis_is_checked():
    assert COMMITTED == sorted(REGENERABLE + OLDER)
    assert {"study", "study_check", "study_grid"} <= set(REGENERABLE)


_SURFACES: dict[bytes, surface.LossSurfaceFit] = {}
"""Loss surfaces fitted by this module's regenerations, by their inputs (see below)."""


def _fit_loss_surface_once(budget, size, examples, seed_losses, **kw):
    """``surface.fit_loss_surface``, each distinct fit once: a surface check refits its reference
    sweep's surfaces (``study_check`` those of ``study``, ``study_opt_check`` those of
    ``study_opt``), the very fits that sweep's own regeneration made. The fit is deterministic
    in its inputs (seeded replicates), so the one made before is the one the check would make."""
    key = pickle.dumps(
        (
            [np.asarray(a, dtype=float).tobytes() for a in (budget, size, examples)],
            [np.asarray(s, dtype=float).tobytes() for s in seed_losses],
            sorted(kw.items()),
        )
    )
    if key not in _SURFACES:
        _SURFACES[key] = _fit_loss_surface(budget, size, examples, seed_losses, **kw)
    return _SURFACES[key]


_fit_loss_surface = surface.fit_loss_surface


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "study" else n for n in REGENERABLE]
)
def test_committed_analysis_regenerates(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # study_check records its reference sweep as docs/study
    monkeypatch.setattr(surface, "fit_loss_surface", _fit_loss_surface_once)
    assert reproduce.check(Path("docs") / name, tmp_path) == []


def test_study_grid_is_regenerated_with_its_200_replicates(tmp_path, monkeypatch):
    """The grid was analysed with 200 replicates: a regeneration reads that from the committed
    analysis (not the 1,000 default), so it is the grid's own numbers that are compared."""
    committed = json.loads((DOCS / "study_grid" / "analysis.json").read_text())
    assert provenance.recorded_n_boot(committed) == 200
    for name in ("results.jsonl", "sweep.json", "analysis.json"):
        shutil.copy(DOCS / "study_grid" / name, tmp_path / name)
    monkeypatch.chdir(ROOT)
    out = analyze.main([str(tmp_path), "--no-plots"])  # in place, no --n-boot given
    assert out["produced_by"]["n_boot"] == 200
    assert reproduce.compare(committed, out) == []
    # And on this host it now reproduces bit for bit, plots included.
    analyze.main([str(tmp_path)])
    assert provenance.same_environment(
        json.loads((tmp_path / "analysis.json").read_text())["produced_by"]
    )
    assert reproduce.check(tmp_path, tmp_path / "again") == []
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs and pngs == sorted(p.name for p in (tmp_path / "again").glob("*.png"))
    for png in pngs:
        assert (tmp_path / png).read_bytes() == (tmp_path / "again" / png).read_bytes()


def test_analyze_in_place_repeats_the_recorded_surface_check_and_names_a_bad_record(tmp_path):
    for name in ("results.jsonl", "sweep.json"):
        shutil.copy(DOCS / "study_check" / name, tmp_path / name)
    (tmp_path / "analysis.json").write_text('{"surface_check_reference": "no/such/sweep"}')
    with pytest.raises(SystemExit, match="^no/such/sweep: no results.jsonl"):
        analyze.main([str(tmp_path)])
    (tmp_path / "analysis.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="analysis.json: not a JSON object"):
        analyze.main([str(tmp_path)])


def test_showcase_keys_regenerate_from_its_results_table(monkeypatch):
    """``docs/showcase`` has its results as results.csv only and predates keys the analysis
    writes today (fixed-floor laws, loss surfaces): every key it has regenerates under the rule;
    the added ones are not compared (so its loss surfaces, 20 s of refits, are not fitted)."""
    monkeypatch.setattr(analyze, "_loss_surface", lambda *a, **k: {})
    committed = json.loads((DOCS / "showcase" / "analysis.json").read_text())
    df = pd.read_csv(DOCS / "showcase" / "results.csv")
    ref = analyze.bayes_reference_of(df, committed["metric"])
    out = analyze.analyze(df, committed["metric"], n_boot=1000, floor=ref)
    out["bayes_reference"] = ref
    assert reproduce.compare(committed, analyze._public(out), subset=True) == []


def _first(node, pred, path=""):
    """(path, value) of the first leaf of a JSON value for which pred(path, value) holds."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = ((f"[{i}]", v) for i, v in enumerate(node))
    else:
        return (path, node) if pred(path, node) else None
    for k, v in items:
        sub = f"{path}{k}" if k.startswith("[") else f"{path}/{k}"
        if got := _first(v, pred, sub):
            return got
    return None


def _set(node, path, value):
    parts = [p for p in path.replace("[", "/[").split("/") if p]
    for p in parts[:-1]:
        node = node[int(p[1:-1])] if p.startswith("[") else node[p]
    last = parts[-1]
    node[int(last[1:-1]) if last.startswith("[") else last] = value


@pytest.mark.parametrize(
    ("where", "rtol"),
    [("/families/dlrm/law/", reproduce.RTOL), ("loss_surface", reproduce.SURFACE_RTOL)],
)
def test_the_rule_holds_a_float_to_its_tolerance(where, rtol):
    committed = json.loads((DOCS / "study" / "analysis.json").read_text())
    path, x = _first(committed, lambda p, v: where in p and type(v) is float and abs(v) > 1e-3)
    for factor, ok in ((1 + rtol / 2, True), (1 + 2 * rtol, False)):
        changed = json.loads(json.dumps(committed))
        _set(changed, path, x * factor)
        assert (reproduce.compare(committed, changed) == []) is ok, (path, factor)
        assert reproduce.compare(committed, changed, exact=True) == [
            f"{path}: {x!r} != {x * factor!r}"
        ]


def test_the_rule_wants_the_same_discrete_answers_and_keys():
    committed = json.loads((DOCS / "study" / "analysis.json").read_text())
    for pred, new in (
        (lambda p, v: p.endswith("/interior"), lambda v: not v),
        (lambda p, v: p.endswith("/replicates_dropped"), lambda v: v + 1),
        (lambda p, v: p.endswith("/rung"), lambda v: v + "x"),
    ):
        path, v = _first(committed, pred)
        changed = json.loads(json.dumps(committed))
        _set(changed, path, new(v))
        assert reproduce.compare(committed, changed) == [f"{path}: {v!r} != {new(v)!r}"]
    changed = json.loads(json.dumps(committed))
    changed["families"]["dlrm"]["extra"] = 1.0
    del changed["families"]["wukong"]["isoflop"]
    assert sorted(reproduce.compare(committed, changed)) == [
        "/families/dlrm/extra: added",
        "/families/wukong/isoflop: missing",
    ]
    # An analysis committed without ``produced_by`` is compared without it.
    bare = {k: v for k, v in committed.items() if k != "produced_by"}
    assert reproduce.compare(bare, bare | {"produced_by": {"n_boot": 1000}}) == []
    with_rec = bare | {"produced_by": {"n_boot": 200, "bootstrap_seed": 0}}
    assert reproduce.compare(with_rec, bare | {"produced_by": {"n_boot": 1000}}) == [
        "/produced_by/n_boot: 200 != 1000"
    ]


def test_reproduce_cli_names_a_folder_without_results(tmp_path):
    (tmp_path / "analysis.json").write_text("{}")
    with pytest.raises(SystemExit, match="no results.jsonl"):
        reproduce.main([str(tmp_path)])
