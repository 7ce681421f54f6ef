"""The loss surface L(N, D) = E + A·(N/N0)^(−α) + B·(D/D0)^(−β) over a whole IsoFLOP grid.

N is a model's size (training FLOPs per example, as in the IsoFLOP analysis), D the training
examples it saw; a trial's compute is C = N·D. This is the third of Chinchilla's three ways to
the compute-optimal allocation (Hoffmann et al. 2022, approach 3): where the IsoFLOP parabolas
(``fit.isoflop_optimum``, approach 2) need each budget's minimum inside its sampled sizes, the
surface uses every cell of every budget, and its optimum follows in closed form: with D = C/N,
∂L/∂N = 0 gives

    N_opt(C) = N0 · (αA / (βB))^(1/(α+β)) · (C / (N0·D0))^a,   a = β / (α + β),

so how the optimal size grows with compute is set by how fast each term falls: a model-size
term that falls faster than the data term (α > β) puts most new compute into examples. The
price: N_opt is read off a fitted formula, so where it falls outside the sizes a budget sampled
it is an extrapolation, and ``optimum`` says so per budget.

Fit: Huber regression of log L on the cells' seed means (as Chinchilla, and as ``fit`` does for
L(C)), E = min(L)·expit(θ_E) (or fixed at a known floor), A, α, B, β = exp(θ). The estimate:
scipy's ``least_squares`` (one problem) from a grid of exponent starts with A and B by
non-negative least squares. Huber δ = 1.345·σ̂ from a least-squares fit's residuals (as
``fit``). Intervals: the seed bootstrap of ``fit.seed_bootstrap_frontier`` (each cell's seeds
redrawn, same replicates for the same ``seed``); with one seed per cell, a pairs bootstrap over
the cells instead. Every replicate is refitted from the estimate (θ_E re-expressed against the
replicate's own minimum), all at once: ``solver.levenberg_marquardt``, ``fit``'s batched IRLS
Levenberg–Marquardt, over R problems of 5 parameters (4 with a fixed floor). A row stops, as
scipy does, once an accepted step gains less than 1e-8 of its objective (or its step or damping
says it is at a minimum). A row still gaining after 1,000 steps (an ill-determined surface's
flat valley in E, A, α) is finished by scipy's ``least_squares`` from where it stopped; only one
that neither solver converges is dropped and counted (``replicates_dropped``). On
well-determined surfaces the batched refits agree with scipy's to ~1e-4; on ill-determined ones
both stop at points along the valley that depend on the path. Against a scipy refit per
replicate (before 2026-11-28) this is 3x less CPU for the committed analyses and drops fewer
replicates (``docs/study_opt``'s DLRM 19 of 400 then, none now). Percentile intervals. Their
coverage (measured with a scipy refit per replicate), on 60 simulated grids like the study's
(7 budgets × 5 sizes, 3 seeds, log-normal seed noise σ = 0.003, 200 replicates;
``tests/sweeps/test_surface.py``'s generator): E 0.95, α 0.92, β 0.97, a 0.92, so slightly
narrow, as plain percentile intervals are at this size (``fit``'s docstring). With one seed per
cell (pairs over cells, t-expanded tails) a's coverage was lower, 0.83-0.87 over 30 grids:
read those intervals as too narrow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from scipy import optimize, special

from sweeps import fit as fit_lib
from sweeps import solver

_EXPONENT_STARTS = (0.1, 0.3, 1.0)
_FLOOR_STARTS = (0.3, 0.7, 0.95)  # E as a fraction of min(L)
_NAMES = ("E", "A", "alpha", "B", "beta", "a")
_MIN_CELLS = 10
_FTOL = 1e-8  # scipy's default: stop once a step gains less than this of the objective
_MAX_ITER = 1000  # as scipy's max_nfev before: a row still gaining after it is dropped


def _unpack(theta: np.ndarray, floor: float | None, min_loss: float) -> np.ndarray:
    """(E, A, alpha, B, beta) [..., 5] from solver coordinates [..., 5]."""
    e = (
        min_loss * special.expit(theta[..., 0])
        if floor is None
        else np.full(theta.shape[:-1], floor)
    )
    return np.stack([e, *np.exp(np.moveaxis(theta[..., 1:], -1, 0))], -1)


def _predict(p: np.ndarray, n: np.ndarray, d: np.ndarray) -> np.ndarray:
    """L at normalised sizes n = N/N0 and data d = D/D0, parameters p [..., 5] (broadcasts)."""
    e, a, al, b, be = np.moveaxis(p, -1, 0)
    return e[..., None] + a[..., None] * n ** -al[..., None] + b[..., None] * d ** -be[..., None]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LossSurfaceFit:
    """A fitted L(N, D) with its bootstrap replicates (``samples`` [R, 5]: E, A, α, B, β)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    n0: float
    d0: float
    floor_fixed: bool
    intervals: dict[str, tuple[float, float]]
    rms_log_residual: float
    huber_delta: float
    n_cells: int
    ci: float
    resampling: str
    """``seeds``: each cell's seeds redrawn; ``cells``: pairs bootstrap over the cells."""
    df: int | None
    """Degrees of freedom of the t-expanded tails (``cells``); None: plain percentiles."""
    replicates_dropped: int
    """Replicates whose refit failed or did not converge (not in ``samples``)."""
    samples: np.ndarray

    @property
    def a(self) -> float:
        """The optimal-size exponent: N_opt ∝ C^a."""
        return self.beta / (self.alpha + self.beta)

    def predict(self, size, examples, samples: bool = False) -> np.ndarray:
        """L(N, D) [K], or [R, K] of the bootstrap replicates with ``samples``."""
        p = self.samples if samples else np.array([self.E, self.A, self.alpha, self.B, self.beta])
        n = np.atleast_1d(np.asarray(size, dtype=float)) / self.n0
        d = np.atleast_1d(np.asarray(examples, dtype=float)) / self.d0
        return _predict(p, n, d)

    def prediction(self, size, examples) -> list[dict[str, float]]:
        """Per cell: the surface's L(N, D) and its interval (the mean curve's, from the
        replicates; a new trial's own seed noise comes on top)."""
        est, reps = self.predict(size, examples), self.predict(size, examples, samples=True)
        lo, hi = fit_lib._interval(reps, self.ci, self.df)
        return [
            {"predicted": float(e), "interval": [float(a), float(b)]}
            for e, a, b in zip(est, lo, hi, strict=True)
        ]

    def optimal_size(self, compute, samples: bool = False) -> np.ndarray:
        """N_opt(C) [K], or [R, K] of the bootstrap replicates with ``samples``."""
        p = self.samples if samples else np.array([[self.E, self.A, self.alpha, self.B, self.beta]])
        _, ca, al, cb, be = (p[:, i : i + 1] for i in range(5))
        c = np.log(np.atleast_1d(np.asarray(compute, dtype=float)) / (self.n0 * self.d0))[None]
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            log_n = (np.log(al * ca / (be * cb)) + be * c) / (al + be)
        out = self.n0 * np.exp(log_n)
        return out if samples else out[0]

    def optimal_loss(self, compute) -> np.ndarray:
        """L at N_opt(C) [K]."""
        c = np.atleast_1d(np.asarray(compute, dtype=float))
        n = self.optimal_size(c) / self.n0
        d = c / (n * self.n0) / self.d0
        return self.E + self.A * n**-self.alpha + self.B * d**-self.beta

    def law_str(self) -> str:
        return (
            f"L = {self.E:.4f} + {self.A:.3g}·(N/{self.n0:.3g})^-{self.alpha:.3f} + "
            f"{self.B:.3g}·(D/{self.d0:.3g})^-{self.beta:.3f}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("samples")
        d["intervals"] = {k: [float(v) for v in lh] for k, lh in self.intervals.items()}
        d |= {"a": self.a, "n_boot": len(self.samples), "law": self.law_str()}
        return d


def _fit_one(n, d, y_log, delta, floor, min_loss, theta0=None) -> tuple[np.ndarray, float]:
    """Huber fit of one problem; from ``theta0`` (a bootstrap refit near the estimate) or from
    the grid of starts. (θ [5], cost); cost inf when the solve failed or did not converge."""
    # Enough evaluations for ill-determined surfaces too: at 200, a quarter of DCNv2's study
    # replicates stopped short, and dropping them cut off the low end of a's interval.
    max_nfev = 1000

    ln_n, ln_d = np.log(n), np.log(d)

    def params(theta):  # _unpack's values for one problem, without its array plumbing
        e = min_loss * special.expit(theta[0]) if floor is None else floor
        return (e, *np.exp(theta[1:]))

    def resid(theta):
        e, a, al, b, be = params(theta)
        return y_log - np.log(e + a * n**-al + b * d**-be)

    def jac(theta):  # ∂r/∂θ [K, 5]
        e, a, al, b, be = params(theta)
        tn, td = a * n**-al, b * d**-be
        de = e * (1 - special.expit(theta[0])) if floor is None else 0.0
        return (
            -np.stack([np.full_like(n, de), tn, -tn * al * ln_n, td, -td * be * ln_d], -1)
            / (e + tn + td)[:, None]
        )

    def solve(t0):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            s = optimize.least_squares(
                resid, t0, jac=jac, loss="huber", f_scale=delta, x_scale="jac", max_nfev=max_nfev
            )
        return (s.x, float(s.cost)) if np.isfinite(s.cost) and s.status > 0 else (t0, np.inf)

    if theta0 is not None:
        return solve(theta0)
    best = (None, np.inf)
    y = np.exp(y_log)
    fracs = _FLOOR_STARTS if floor is None else (None,)
    for frac in fracs:
        e = floor if frac is None else frac * min_loss
        for al in _EXPONENT_STARTS:
            for be in _EXPONENT_STARTS:
                coef, _ = optimize.nnls(np.stack([n**-al, d**-be], -1), y - e)
                coef = np.maximum(coef, 1e-6)
                te = 0.0 if frac is None else float(special.logit(frac))
                got = solve(
                    np.array([te, np.log(coef[0]), np.log(al), np.log(coef[1]), np.log(be)])
                )
                if got[1] < best[1]:
                    best = got
    if best[0] is None:
        raise ValueError("the loss surface fit failed from every start")
    return best


def _log_residuals(theta, ln_n, ln_d, y_log, min_loss, floor, jac: bool):
    """Log residuals [R, K] of R problems (cells ``ln_n``, ``ln_d``, ``y_log`` [R, K], E's bound
    ``min_loss`` [R]) at θ [R, 5], or [R, 4] without θ_E for a fixed floor; and ∂log(pred)/∂θ
    [R, K, P] with ``jac`` (``solver.levenberg_marquardt``'s convention)."""
    if floor is None:
        s = special.expit(theta[:, 0])
        e, rest = min_loss * s, theta[:, 1:]
    else:
        e, rest = np.full(len(theta), floor), theta
    ca, al, cb, be = (v[:, None] for v in np.exp(rest).T)
    tn, td = ca * np.exp(-al * ln_n), cb * np.exp(-be * ln_d)
    pred = e[:, None] + tn + td
    r = y_log - np.log(pred)
    if not jac:
        return r
    cols = [tn, -al * ln_n * tn, td, -be * ln_d * td]
    if floor is None:
        cols.insert(0, np.broadcast_to((e * (1 - s))[:, None], tn.shape))
    return r, np.stack(cols, -1) / pred[..., None]


def _refit_replicates(th, e_est, n, d, boot_rk, idx_rk, delta, floor) -> np.ndarray:
    """The bootstrap replicates' refits [R', 5] (E, A, α, B, β) from the estimate θ ``th``: one
    batched solve (``solver.levenberg_marquardt``); replicates that do not converge are left
    out."""
    m_r = boot_rk.min(-1)  # E's bound follows each replicate's own minimum
    ln_n, ln_d, y_log = np.log(n)[idx_rk], np.log(d)[idx_rk], np.log(boot_rk)
    t0 = np.tile(th, (len(boot_rk), 1))
    if floor is None:  # the same E in each replicate's coordinates (off the bound, where
        t0[:, 0] = special.logit(np.minimum(e_est / m_r, 0.99))  # ∂E/∂θ would vanish)
    else:
        t0 = t0[:, 1:]

    def residuals(rows, theta, jac):
        return _log_residuals(theta, ln_n[rows], ln_d[rows], y_log[rows], m_r[rows], floor, jac)

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        tb, obj, ok = solver.levenberg_marquardt(
            t0, residuals, np.full(len(t0), delta), max_iter=_MAX_ITER, ftol=_FTOL
        )
    ok &= np.isfinite(obj)
    if floor is not None:
        tb = np.column_stack([np.zeros(len(tb)), tb])
    # A row still moving at the cap (an ill-determined surface's flat valley) is finished by
    # scipy from where the batched solve left it, so that no replicate is dropped for the
    # batched solver's sake: only one that neither converges is (dropping them cuts off an
    # interval's end, ``_fit_one``'s note).
    for r in np.flatnonzero(~ok):
        idx = idx_rk[r]
        tb[r], cost = _fit_one(n[idx], d[idx], y_log[r], delta, floor, m_r[r], tb[r])
        ok[r] = np.isfinite(cost)
    return _unpack(tb[ok], floor, m_r[ok])


def fit_loss_surface(
    budget,
    size,
    examples,
    seed_losses,
    *,
    n_boot: int = 1000,
    seed: int = 0,
    ci: float = 0.95,
    floor: float | None = None,
) -> LossSurfaceFit:
    """Fit L(N, D) to an IsoFLOP grid's cells.

    Args:
      budget: [K] each cell's budget (only to name a bad cell and to draw the same replicates
        as ``fit.seed_bootstrap_frontier``).
      size: [K] the cell's model size N (training FLOPs per example).
      examples: [K] the examples D its trials trained on.
      seed_losses: K arrays, the final loss of each seed of the cell.
      floor: a known floor (the Bayes-optimal loss) to fix E at; None fits E in (0, min L).
    """
    budget = np.asarray(budget, dtype=float)
    size, examples = np.asarray(size, dtype=float), np.asarray(examples, dtype=float)
    if not (budget.shape == size.shape == examples.shape == (len(seed_losses),)):
        raise ValueError("budget, size, examples and seed_losses need one entry per cell")
    for name, arr in (("size", size), ("examples", examples)):
        if (bad := np.flatnonzero(~(np.isfinite(arr) & (arr > 0)))).size:
            raise ValueError(f"{name}[{bad[0]}] = {arr[bad[0]]:g}: must be finite and > 0")
    # Two cells per parameter at least, over 3 budgets: fewer leave the five parameters (and the
    # bootstrap's refits) all but undetermined.
    if size.size < _MIN_CELLS or np.unique(budget).size < 3 or np.unique(size).size < 2:
        raise ValueError(
            f"a surface of 5 parameters needs >= {_MIN_CELLS} cells over >= 3 "
            f"budgets and >= 2 sizes; got {size.size} cells, "
            f"{np.unique(budget).size} budgets"
        )
    mean_k, boot_rk = fit_lib._seed_replicates(budget, seed_losses, n_boot, seed)
    if (bad := np.flatnonzero(mean_k <= 0)).size:
        raise ValueError(
            f"cell {bad[0]} (budget {budget[bad[0]]:.3g}): mean loss {mean_k[bad[0]]:g} must be > 0"
        )
    # Seeds are resampled only when every cell has several (a one-seed cell would not vary).
    seeded = min(len(v) for v in seed_losses) > 1
    if seeded:
        idx_rk = np.broadcast_to(np.arange(size.size), boot_rk.shape)
    else:  # one seed per cell: pairs bootstrap over the cells instead
        idx_rk = np.random.default_rng(seed).integers(0, size.size, size=boot_rk.shape)
        boot_rk = mean_k[idx_rk]
    floor = fit_lib._check_floor(floor, np.concatenate([mean_k, boot_rk.ravel()]))
    n0, d0 = float(np.exp(np.log(size).mean())), float(np.exp(np.log(examples).mean()))
    n, d = size / n0, examples / d0
    min_loss = float(mean_k.min())
    k = 5 if floor is None else 4
    # δ: 1.345·σ̂ of a least-squares fit's residuals (as solver.huber_scale, one round).
    th, _ = _fit_one(n, d, np.log(mean_k), 1e6, floor, min_loss)
    r = np.log(mean_k) - np.log(_predict(_unpack(th, floor, min_loss), n, d))
    mad = np.median(np.abs(r - np.median(r)))
    delta = 1.345 * max(1.4826 * mad * np.sqrt(n.size / max(n.size - k, 1)), solver.SIGMA_FLOOR)
    th, _ = _fit_one(n, d, np.log(mean_k), delta, floor, min_loss)
    est = _unpack(th, floor, min_loss)
    boot = _refit_replicates(th, est[0], n, d, boot_rk, idx_rk, delta, floor)
    if len(boot) < max(20, n_boot // 2):
        raise ValueError(f"only {len(boot)} of {n_boot} bootstrap refits converged")
    q = np.column_stack([boot, boot[:, 4] / (boot[:, 2] + boot[:, 4])])
    # Pairs over cells: t-expanded tails on K - (fitted parameters) degrees of freedom, as fit.py.
    df = None if seeded else size.size - k
    lo, hi = fit_lib._interval(q, ci, df)
    resid = np.log(mean_k) - np.log(_predict(est, n, d))
    return LossSurfaceFit(
        E=float(est[0]),
        A=float(est[1]),
        alpha=float(est[2]),
        B=float(est[3]),
        beta=float(est[4]),
        n0=n0,
        d0=d0,
        floor_fixed=floor is not None,
        intervals={k: (float(a), float(b)) for k, a, b in zip(_NAMES, lo, hi, strict=True)},
        rms_log_residual=float(np.sqrt(np.mean(resid**2))),
        huber_delta=float(delta),
        n_cells=int(size.size),
        ci=ci,
        samples=boot,
        resampling="seeds" if seeded else "cells",
        df=df,
        replicates_dropped=n_boot - len(boot),
    )


def surface_optima(surface: LossSurfaceFit, budget, size) -> list[dict[str, Any]]:
    """Per budget: the surface's N_opt with its interval and whether it lies inside the sizes
    that budget sampled (else the optimum is an extrapolation of the formula)."""
    budget, size = np.asarray(budget, dtype=float), np.asarray(size, dtype=float)
    out = []
    for b in np.unique(budget):
        s = size[budget == b]
        opt = float(surface.optimal_size(b)[0])
        reps = surface.optimal_size(b, samples=True)[:, 0]
        reps = reps[np.isfinite(reps)]
        lo, hi = (
            fit_lib._interval(reps[:, None], surface.ci, surface.df)
            if reps.size
            else ([np.nan], [np.nan])
        )
        out.append(
            {
                "budget": float(b),
                "size_opt": opt,
                "size_opt_interval": [float(lo[0]), float(hi[0])],
                "loss_opt": float(surface.optimal_loss(b)[0]),
                "sampled_sizes": [float(s.min()), float(s.max())],
                "inside_sampled": bool(s.min() <= opt <= s.max()),
                "interval_inside_sampled": bool(s.min() <= lo[0] and hi[0] <= s.max()),
            }
        )
    return out
