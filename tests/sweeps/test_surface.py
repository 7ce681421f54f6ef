"""``sweeps.surface``: the loss surface L(N, D) over an IsoFLOP grid, and its compute-optimal size."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import optimize, special

from sweeps import analyze, surface
from sweeps.store import SweepStore

# L = E + A·(N/1e5)^-alpha + B·(D/1e6)^-beta: the optimal size grows as C^(0.3/0.7) = C^0.43.
TRUTH = {"E": 0.45, "A": 0.03, "alpha": 0.4, "B": 0.05, "beta": 0.3}
A_TRUE = TRUTH["beta"] / (TRUTH["alpha"] + TRUTH["beta"])
BUDGETS = np.geomspace(1e9, 1e12, 7)


def _loss(n, d):
    t = TRUTH
    return t["E"] + t["A"] * (n / 1e5) ** -t["alpha"] + t["B"] * (d / 1e6) ** -t["beta"]


def _opt(c):  # the closed form, N0 = 1e5, D0 = 1e6
    t = TRUTH
    k = (t["alpha"] * t["A"] / (t["beta"] * t["B"])) ** (1 / (t["alpha"] + t["beta"]))
    return 1e5 * k * (c / 1e11) ** A_TRUE


def grid(*, seeds=3, noise=0.0, spread=(0.25, 0.5, 1.0, 2.0, 4.0), seed=0):
    """An IsoFLOP grid around the true optimum: (budget, size, examples, seed losses) per cell."""
    rng = np.random.default_rng(seed)
    cells = []
    for c in BUDGETS:
        for f in spread:
            n = _opt(c) * f
            y = _loss(n, c / n)
            cells.append((c, n, c / n, y * np.exp(rng.normal(0, noise, seeds)) if noise else [y]))
    b, n, d, y = zip(*cells, strict=True)
    return np.array(b), np.array(n), np.array(d), [np.asarray(v, dtype=float) for v in y]


def test_recovers_a_noiseless_surface_and_its_closed_form_optimum():
    fit = surface.fit_loss_surface(*grid(), n_boot=20)
    assert fit.a == pytest.approx(A_TRUE, rel=1e-3)
    assert fit.alpha == pytest.approx(TRUTH["alpha"], rel=1e-3)
    assert fit.beta == pytest.approx(TRUTH["beta"], rel=1e-3)
    assert fit.E == pytest.approx(TRUTH["E"], rel=1e-4)
    assert fit.rms_log_residual < 1e-6
    for c in (1e9, 3e10, 1e12):
        # The closed form against a numerical minimum of L(N, C/N) over N.
        res = optimize.minimize_scalar(
            lambda u, c=c: _loss(np.exp(u), c / np.exp(u)),
            bounds=(np.log(10.0), np.log(1e9)),
            method="bounded",
            options={"xatol": 1e-10},
        )
        assert fit.optimal_size(c)[0] == pytest.approx(np.exp(res.x), rel=2e-3)
        assert fit.optimal_loss(c)[0] == pytest.approx(res.fun, rel=1e-5)
    opts = surface.surface_optima(fit, *grid()[:2])
    assert all(o["inside_sampled"] for o in opts) and len(opts) == 7


def test_seed_bootstrap_intervals_contain_the_truth():
    fit = surface.fit_loss_surface(*grid(noise=0.003, seed=3), n_boot=200)
    assert fit.resampling == "seeds" and fit.samples.shape == (200, 5)
    # (A and B depend on the fit's normalisation N0, D0; these do not. Coverage over 60 such
    # grids is in sweeps/surface.py's docstring; this grid is one where all four hit, as 5 of the first 8 seeds do.)
    for name in ("E", "alpha", "beta", "a"):
        true = A_TRUE if name == "a" else TRUTH[name]
        lo, hi = fit.intervals[name]
        assert lo < true < hi, (name, lo, true, hi)
    lo, hi = fit.intervals["a"]
    assert hi - lo < 0.3  # informative, not the whole (0, 1)
    # The prediction of a cell the grid lacks, with its interval.
    (p,) = fit.prediction([3e5], [1e12 / 3e5])
    assert p["interval"][0] < _loss(3e5, 1e12 / 3e5) < p["interval"][1]


def test_one_seed_per_cell_resamples_cells_and_a_fixed_floor_is_kept():
    b, n, d, y = grid(noise=0.003, seeds=1)
    fit = surface.fit_loss_surface(b, n, d, y, n_boot=100, floor=TRUTH["E"])
    assert fit.resampling == "cells" and fit.df == len(b) - 4
    assert fit.floor_fixed and fit.E == TRUTH["E"]
    lo, hi = fit.intervals["a"]
    # (Pairs over cells cover a less often than seeds do: 0.83-0.87 over 30 such grids, see
    # sweeps/surface.py; so this checks the estimate and a real spread, not coverage.)
    assert fit.a == pytest.approx(A_TRUE, abs=0.03) and 0.005 < hi - lo < 0.3 and lo < fit.a < hi
    assert np.all(fit.samples[:, 0] == TRUTH["E"])


def test_mixed_seed_counts_resample_cells():
    b, n, d, y = grid(noise=0.003)
    y[4] = y[4][:1]  # one cell with a single seed would not vary under a seed bootstrap
    assert surface.fit_loss_surface(b, n, d, y, n_boot=50).resampling == "cells"


def test_jacobian_matches_finite_differences():
    b, n, d, y = grid(noise=0.003)
    y_log = np.log([v.mean() for v in y])
    real = optimize.least_squares
    for floor in (None, 0.44):
        theta = np.array([0.3, np.log(0.02), np.log(0.5), np.log(0.04), np.log(0.2)])
        got = {}

        def spy(fun, x0, jac, got=got, **kw):  # the residual and Jacobian the fit hands scipy
            got.update(fun=fun, jac=jac)
            return real(fun, x0, jac=jac, **kw)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(surface.optimize, "least_squares", spy)
            surface._fit_one(n / 1e5, d / 1e6, y_log, 0.01, floor, 0.5, theta)
        h = 1e-6 * np.eye(5)  # central differences
        num = np.stack([(got["fun"](theta + e) - got["fun"](theta - e)) / 2e-6 for e in h], -1)
        np.testing.assert_allclose(got["jac"](theta), num, rtol=1e-6, atol=1e-9)


def test_batched_jacobian_matches_finite_differences():
    b, n, d, y = grid(noise=0.003)
    ln_n, ln_d = np.log(n / 1e5)[None], np.log(d / 1e6)[None]
    y_log = np.log([v.mean() for v in y])[None]
    theta = np.array([0.3, np.log(0.02), np.log(0.5), np.log(0.04), np.log(0.2)])
    for floor, th in ((None, theta), (0.44, theta[1:])):

        def r(t, floor=floor):
            return surface._log_residuals(t[None], ln_n, ln_d, y_log, np.array([0.5]), floor, False)

        _, dlogp = surface._log_residuals(
            th[None], ln_n, ln_d, y_log, np.array([0.5]), floor, jac=True
        )
        h = 1e-6 * np.eye(th.size)  # central differences; ∂r/∂θ = -∂log(pred)/∂θ
        num = np.stack([(r(th + e) - r(th - e))[0] / 2e-6 for e in h], -1)
        np.testing.assert_allclose(-dlogp[0], num, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(("seeds", "floor"), [(3, None), (3, TRUTH["E"]), (1, None)])
def test_batched_refits_match_scipy_on_the_same_replicates(seeds, floor):
    """Every replicate's batched refit against scipy's least_squares from the same start on the
    same data (seeds redrawn, or cells resampled with one seed): the same Huber optimum, to
    2e-4 relative in each parameter (both stop at a gain below 1e-8 of the objective, which
    leaves well-determined parameters within ~1e-4 of the optimum; 6e-5 seen here)."""
    b, n, d, y = grid(noise=0.003, seeds=seeds, seed=3)
    fit = surface.fit_loss_surface(b, n, d, y, n_boot=40, floor=floor)
    assert fit.replicates_dropped == 0 and fit.samples.shape == (40, 5)
    mean_k, boot_rk = surface.fit_lib._seed_replicates(b, y, 40, 0)
    idx_rk = np.broadcast_to(np.arange(n.size), boot_rk.shape)
    if seeds == 1:
        idx_rk = np.random.default_rng(0).integers(0, n.size, size=boot_rk.shape)
        boot_rk = mean_k[idx_rk]
    nn, dd = n / fit.n0, d / fit.d0
    est = np.array([fit.E, fit.A, fit.alpha, fit.B, fit.beta])
    th = np.log(est)
    th[0] = 0.0
    for k, (yb, idx) in enumerate(zip(boot_rk, idx_rk, strict=True)):
        m = yb.min()
        if floor is None:
            th[0] = special.logit(min(fit.E / m, 0.99))
        tb, cost = surface._fit_one(nn[idx], dd[idx], np.log(yb), fit.huber_delta, floor, m, th)
        assert np.isfinite(cost)
        np.testing.assert_allclose(fit.samples[k], surface._unpack(tb, floor, m), rtol=2e-4)


def test_replicates_left_moving_are_finished_by_scipy_or_dropped_and_counted(monkeypatch):
    b, n, d, y = grid(noise=0.003, seed=3)
    full = surface.fit_loss_surface(b, n, d, y, n_boot=60)
    assert full.replicates_dropped == 0
    monkeypatch.setattr(surface, "_MAX_ITER", 12)  # too few steps for some replicates
    fit_one, polished = surface._fit_one, []

    def polish(*args, theta0=None, fail=False):
        if theta0 is None:  # the estimate's fits, from the grid of starts
            return fit_one(*args)
        polished.append(theta0)
        return (theta0, np.inf) if fail else fit_one(*args, theta0)

    def finish(fail):
        polished.clear()
        monkeypatch.setattr(
            surface,
            "_fit_one",
            lambda *a: polish(*a[:6], theta0=a[6] if len(a) > 6 else None, fail=fail),
        )
        return surface.fit_loss_surface(b, n, d, y, n_boot=60)

    cut = finish(fail=False)
    assert 0 < len(polished) < 30  # scipy finished the rows the batched solve left moving
    assert cut.replicates_dropped == 0
    np.testing.assert_allclose(cut.samples, full.samples, rtol=2e-4)
    cut = finish(fail=True)  # and where scipy fails too, the row is dropped and counted
    assert cut.replicates_dropped == len(polished) > 0
    assert len(cut.samples) == 60 - cut.replicates_dropped
    monkeypatch.setattr(surface, "_MAX_ITER", 1)
    with pytest.raises(ValueError, match="bootstrap refits converged"):
        finish(fail=True)


def test_optimum_outside_the_sampled_sizes_is_flagged_as_extrapolated():
    b, n, d, y = grid(spread=(4.0, 8.0, 16.0, 32.0))  # every size above the optimum
    fit = surface.fit_loss_surface(b, n, d, y, n_boot=20)
    opts = surface.surface_optima(fit, b, n)
    assert not any(o["inside_sampled"] for o in opts)
    assert all(o["size_opt"] < o["sampled_sizes"][0] for o in opts)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda b, n, d, y: (b, n.copy() * np.r_[1, 1, -1, np.ones(n.size - 3)], d, y),
            r"size\[2\]",
        ),
        (lambda b, n, d, y: (b[:9], n[:9], d[:9], y[:9]), "needs >= 10 cells"),
        (lambda b, n, d, y: (b[:10], n[:10], d[:10], y[:10]), "got 10 cells, 2 budgets"),
        (lambda b, n, d, y: (b, n, d, y[:-1]), "one entry per cell"),
        (lambda b, n, d, y: (b, n, d, [*y[:3], np.zeros(1), *y[4:]]), r"cell 3 .*must be > 0"),
    ],
)
def test_bad_input_names_the_problem(change, match):
    with pytest.raises(ValueError, match=match):
        surface.fit_loss_surface(*change(*grid()), n_boot=10)


def _write_sweep(root, b, n, y, family="dlrm"):
    store, ids = SweepStore(root), []
    for k, (budget, size, v) in enumerate(zip(b, n, y, strict=True)):
        for s, loss in enumerate(v):
            ids.append(tid := f"{family}-{k}-{s}")
            store.append_result(
                {
                    "trial_id": tid,
                    "status": "SUCCESS",
                    "family": family,
                    "rung": f"r{size:.4g}",
                    "rung_index": k,
                    "budget": float(budget),
                    "compute": float(budget),
                    "flops_per_example": float(size),
                    "steps": 100,
                    "params_dense": 10,
                    "wall_time_s": 1.0,
                    "seed": s,
                    "final": {"logloss": float(loss), "auc": 0.7},
                    "best": {"logloss": float(loss), "auc": 0.7},
                    "config": {},
                    "versions": {},
                    "diverged_at_step": None,
                }
            )
    sweep = root / "sweep.json"
    ids = (json.loads(sweep.read_text())["trial_ids"] if sweep.exists() else []) + ids
    sweep.write_text(json.dumps({"name": "t", "metric": "logloss", "trial_ids": ids}))


def test_analyze_reports_the_surface_and_checks_held_out_cells(tmp_path):
    ref, chk = tmp_path / "ref", tmp_path / "check"
    # The reference grid samples only sizes above the optimum (as the study did): the IsoFLOP
    # minima sit at the edge, the surface still finds the optimum.
    b, n, _, y = grid(noise=0.002, spread=(2.0, 4.0, 8.0, 16.0))
    _write_sweep(ref, b, n, y)
    out = analyze.main([str(ref), "--n-boot", "100", "--no-plots"])
    d = out["families"]["dlrm"]
    assert not any(i["interior"] for i in d["isoflop"])
    ls = d["loss_surface"]
    assert ls["intervals"]["a"][0] < A_TRUE < ls["intervals"]["a"][1]
    assert not any(o["inside_sampled"] for o in ls["optima"])
    # The check sweep: the optimum's size at the top budget, which the reference never ran, 3
    # noisy seeds; and a family the reference lacks.
    top, n_opt = BUDGETS[-1], _opt(BUDGETS[-1])
    noisy = _loss(n_opt, top / n_opt) * np.exp(np.random.default_rng(9).normal(0, 0.002, 3))
    _write_sweep(chk, [top], [n_opt], [noisy])
    _write_sweep(chk, [top], [n_opt], [noisy], family="wukong")
    got = analyze.main([str(chk), "--n-boot", "100", "--no-plots", "--surface-from", str(ref)])
    (cell,) = got["surface_check"]["dlrm"]["cells"]
    assert cell["rel_error"] < 0.005 and cell["inside_prediction_interval"]
    pi, iv = cell["prediction_interval"], cell["interval"]
    assert pi[0] < iv[0] < iv[1] < pi[1]  # the seeds' noise widens the curve's interval
    assert cell["reference_best_at_budget"]["y"] > cell["observed"]  # better than any size run
    assert "no wukong trials" in got["surface_check"]["wukong"]["reason"]
    with pytest.raises(SystemExit, match="nowhere: no results.jsonl"):
        analyze.main([str(chk), "--surface-from", str(tmp_path / "nowhere")])
