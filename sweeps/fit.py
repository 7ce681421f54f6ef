"""Scaling-law fits for compute sweeps: L(C) = a·C^(−b) + c with bootstrap intervals; IsoFLOP optima.

L is a loss (lower is better, e.g. eval logloss), C training FLOPs. numpy and scipy only (no jax),
so a sweep's results can be fitted on a laptop.

Shapes: ``R`` independent problems solved together (bootstrap replicates, datasets or both), ``N``
points (trials) per problem, ``K`` query computes, ``Q`` named quantities, ``P = 3`` parameters.

The fit (Huber regression in log space, its solver and Huber scale): ``sweeps.solver``.

Intervals: pairs (case) bootstrap over trials (replicates with < 3 distinct computes redrawn) and
t-expanded percentile intervals: tails at Φ(∓t), t the Student-t critical value on N − 3 degrees
of freedom instead of the normal one (Hesterberg's small-sample expansion; 2.5% → 1.54% at N = 16).
Chosen by simulation with this solver: coverage of nominal 95% intervals for a_norm / b / c, 16
points over 3 decades, 400 replicates, log-normal noise σ:

    case (a_norm, b, c, σ)                percentile      t-percentile    BCa
    0.3, 0.3, 0.3, 0.02 (2000 datasets)
      pairs                               .922 .947 .942  .944 .966 .958  .937 .950 .947 †
      residual (leverage-adjusted)        .912 .911 .913  .936 .936 .940  .911 .922 .926 †
    4 others (600 datasets each), pairs   .927 – .952     .945 – .973     .81 – .96 †
                            residual      —               .918 – .970     —

(others: 0.5, 0.3, 0.1, 0.02 | 0.3, 0.3, 0.3, 0.04 | 0.3, 0.5, 0.3, 0.02 | 0.3, 0.1, 0.3, 0.02;
Monte Carlo s.e. 0.005 and 0.009; † earlier run, δ from the least-squares fit alone.)
Plain percentile intervals are too narrow at N ≈ 16. BCa drops to 0.81–0.87 at b = 0.1, where a
quarter of the replicates sit at the c → 0 boundary and throw off its bias and acceleration terms.
Residual resampling has the right spread (bootstrap s.d. 1.0× the estimates' true s.d., intervals
1.1× their central 95% range, against 1.2× and 1.3× for pairs) but dipped to 0.92 and assumes one
noise level at every compute and an exact power law; pairs never went below 0.93, so the price of
its honesty is intervals ~20% wider. The remaining a_norm miss is one-sided (the estimator's upward
bias, which percentile intervals keep). Intervals of a and of derived quantities come from the
same samples; ``band`` likewise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from scipy import stats

from sweeps.solver import huber_scale, solve

_NAMES = ("a", "a_norm", "b", "c", "slope_per_decade", "reducible_drop_per_decade")


def _check_values(compute, loss) -> tuple[np.ndarray, np.ndarray]:
    """Float arrays compute [N], loss [..., N]; ValueError naming the first bad index."""
    compute, loss = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    if compute.ndim != 1 or loss.shape[-1:] != compute.shape:
        raise ValueError(f"need compute [N] and loss [..., N]; got {compute.shape}, {loss.shape}")
    for name, arr in (("compute", compute), ("loss", loss)):
        bad = np.argwhere(~(np.isfinite(arr) & (arr > 0)))
        if bad.size:
            at = ", ".join(str(i) for i in bad[0])
            raise ValueError(f"{name}[{at}] = {arr[tuple(bad[0])]:g}: must be finite and > 0")
    return compute, loss


# --- intervals -----------------------------------------------------------------------------------


def _quantities(p_rp: np.ndarray, c0: float, lx_max: float) -> np.ndarray:
    """The _NAMES quantities [R, Q] of parameter rows (a_norm, b, c) [R, P]."""
    a_norm, b, c = p_rp.T
    with np.errstate(over="ignore"):
        a = a_norm * np.exp(b * np.log(c0))
    slope = -np.log(10) * b * a_norm * np.exp(-b * lx_max)  # dL/dlog10(C) at the largest C
    return np.stack([a, a_norm, b, c, slope, 1 - 10.0 ** (-b)], -1)


def _interval(boot_rq: np.ndarray, level: float, df: int | None) -> tuple[np.ndarray, np.ndarray]:
    """t-expanded percentile interval (lo [Q], hi [Q]) from bootstrap values [R, Q]: the tails
    are Φ(∓t_df) instead of (1 ∓ level)/2 (2.5% → 1.54% at df = 13); df None: plain percentile."""
    tail = (1 - level) / 2 if df is None else stats.norm.cdf(-stats.t.ppf(0.5 + level / 2, df))
    with np.errstate(invalid="ignore"):  # interpolating between +inf samples (a = a_norm·C0^b)
        lo, hi = np.quantile(boot_rq, [tail, 1 - tail], axis=0)
    return lo, hi


def _pair_indices(rng, compute: np.ndarray, shape: tuple[int, ...], need: int = 3) -> np.ndarray:
    """Trial indices [*shape, N] drawn with replacement; draws with < ``need`` distinct computes
    (the fit's parameter count) redrawn."""
    n = compute.size
    idx = rng.integers(0, n, size=(*shape, n))
    while (bad := (np.diff(np.sort(compute[idx], -1), axis=-1) > 0).sum(-1) < need - 1).any():
        idx[bad] = rng.integers(0, n, size=(int(bad.sum()), n))
    return idx


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class PowerLawFit:
    """L(C) = a·C^(−b) + c = a_norm·(C/c0)^(−b) + c, fitted with bootstrap intervals."""

    a: float
    """Coefficient in original compute units (a_norm·c0^b)."""
    a_norm: float
    """Coefficient at compute scale C/c0: reducible loss at the smallest compute."""
    b: float
    """Exponent (> 0)."""
    c: float
    """Irreducible loss, 0 ≤ c < min(L)."""
    c0: float
    """Compute normaliser: the smallest compute fitted."""
    compute_max: float
    """Largest compute fitted; slope_per_decade is evaluated there."""
    huber_delta: float
    """Huber scale δ, in log-loss units."""
    n_points: int
    """Trials fitted (N)."""
    ci: float
    """Level of ``intervals`` and the default level of ``band``."""
    floor_fixed: bool = False
    """c was given (e.g. the Bayes-optimal loss), not fitted: 2 parameters."""
    resampling: str = "pairs"
    """What the bootstrap resampled: ``pairs`` (trials) or ``seeds`` (each point's seeds)."""
    slope_per_decade: float
    """dL/dlog10(C) at compute_max, in loss units (negative)."""
    reducible_drop_per_decade: float
    """1 − 10^(−b): fraction of the reducible loss L − c removed by 10× compute."""
    intervals: dict[str, tuple[float, float]]
    """Name → (lo, hi) for a, a_norm, b, c, slope_per_decade, reducible_drop_per_decade."""
    samples: np.ndarray = dataclasses.field(repr=False)
    """Bootstrap parameters [R, 3]: (a_norm, b, c), e.g. to draw curves."""

    def _curve(self, p_rp: np.ndarray, compute) -> np.ndarray:
        x_k = np.atleast_1d(np.asarray(compute, dtype=float)) / self.c0
        with np.errstate(over="ignore"):  # a steep bootstrap curve below C0 may reach +inf
            return p_rp[:, :1] * x_k ** -p_rp[:, 1:2] + p_rp[:, 2:]

    def predict(self, compute) -> np.ndarray:
        """Fitted loss [K] at compute (scalar or [K])."""
        return self._curve(np.array([[self.a_norm, self.b, self.c]]), compute)[0]

    def band(self, compute, level: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Pointwise (lo [K], hi [K]) interval of the fitted curve, same method as ``intervals``."""
        level = self.ci if level is None else level
        return _interval(self._curve(self.samples, compute), level, self.df)

    @property
    def df(self) -> int | None:
        """Degrees of freedom of the intervals' t-expansion: points minus fitted parameters for
        pairs resampling; None (plain percentile) for seed resampling, whose replicates carry
        the seeds' own noise rather than a small-sample refit of the points."""
        if self.resampling == "seeds":
            return None
        return max(self.n_points - (2 if self.floor_fixed else 3), 1)

    def law_str(self) -> str:
        """E.g. ``L(C) = 0.4412 + 0.0213·(C/1.2e12)^-0.231``."""
        mant, _, exp = f"{self.c0:.2g}".partition("e")
        c0 = f"{mant}e{int(exp)}" if exp else mant
        return f"L(C) = {self.c:.4f} + {self.a_norm:.4g}·(C/{c0})^-{self.b:.3f}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (no bootstrap arrays)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("samples")
        d["intervals"] = {k: [float(v) for v in lh] for k, lh in self.intervals.items()}
        d["n_boot"], d["law"] = len(self.samples), self.law_str()
        return d


def _check_floor(floor, losses) -> float | None:
    if floor is None:
        return None
    floor = float(floor)
    if not (np.isfinite(floor) and 0 <= floor < losses.min()):
        raise ValueError(
            f"floor {floor:g} must be finite, >= 0 and below every loss (min {losses.min():g})"
        )
    return floor


def fit_power_law_many(
    compute,
    losses,
    *,
    n_boot: int = 1000,
    seed: int = 0,
    ci: float = 0.95,
    huber_delta=None,
    floor: float | None = None,
) -> list[PowerLawFit]:
    """``fit_power_law`` for D datasets sharing one compute grid [N] (losses [D, N]).

    Every dataset's fit and bootstrap replicates go through one batched solve, so a coverage
    simulation over hundreds of datasets takes seconds.
    """
    compute, losses = _check_values(compute, np.atleast_2d(losses))
    floor = _check_floor(floor, losses)
    need = 3 if floor is None else 2
    if (k := np.unique(compute).size) < need:
        raise ValueError(f"need at least {need} distinct compute values to fit; got {k}")
    if n_boot < 2 or not 0 < ci < 1:
        raise ValueError(f"need n_boot >= 2 and 0 < ci < 1; got {n_boot}, {ci}")
    (d, n), c0 = losses.shape, float(compute.min())
    lx_n, y_dn = np.log(compute / c0), np.log(losses)
    lx_dn = np.broadcast_to(lx_n, (d, n))
    floor_d = np.full(d, np.nan if floor is None else floor)
    delta_d = (
        huber_scale(lx_dn, y_dn, floor_r=floor_d)
        if huber_delta is None
        else np.full(d, float(huber_delta))
    )
    est_dp = solve(lx_dn, y_dn, delta_d, floor_d)
    idx = _pair_indices(np.random.default_rng(seed), compute, (d, n_boot), need)  # [D, R, N]
    y_boot = np.take_along_axis(y_dn[:, None, :], idx, -1).reshape(-1, n)
    boot_rp = solve(
        lx_n[idx].reshape(-1, n), y_boot, np.repeat(delta_d, n_boot), np.repeat(floor_d, n_boot)
    )
    return [
        _make_fit(
            est_dp[k],
            boot_rp.reshape(d, n_boot, 3)[k],
            c0=c0,
            compute_max=float(compute.max()),
            huber_delta=float(delta_d[k]),
            n_points=n,
            ci=ci,
            floor_fixed=floor is not None,
            resampling="pairs",
        )
        for k in range(d)
    ]


def _make_fit(est_p, boot_rp, *, c0, compute_max, ci, n_points, floor_fixed, **kw) -> PowerLawFit:
    """A PowerLawFit from the estimate (a_norm, b, c) [P] and bootstrap replicates [R, P]."""
    lx_max = float(np.log(compute_max / c0))
    q_est = _quantities(est_p[None], c0, lx_max)[0]
    df = max(n_points - (2 if floor_fixed else 3), 1) if kw.get("resampling") != "seeds" else None
    lo, hi = _interval(_quantities(boot_rp, c0, lx_max), ci, df)
    return PowerLawFit(
        **dict(zip(_NAMES, q_est.tolist(), strict=True)),
        c0=c0,
        compute_max=compute_max,
        n_points=n_points,
        ci=ci,
        samples=boot_rp,
        floor_fixed=floor_fixed,
        intervals={nm: (float(lo[i]), float(hi[i])) for i, nm in enumerate(_NAMES)},
        **kw,
    )


def fit_power_law(compute, loss, **options) -> PowerLawFit:
    """Robust fit of L(C) = a·C^(−b) + c with bootstrap intervals (see the module docstring).

    Args:
      compute: training FLOPs of each trial [N] (repeats, e.g. seeds, allowed; ≥ 3 distinct).
      loss: loss of each trial [N], finite and > 0.
      **options: :func:`fit_power_law_many`'s keywords: ``n_boot`` bootstrap replicates R
        (pairs resampling over trials, 1000), ``seed`` of the resampling (0), ``ci`` the level
        of the intervals (0.95), ``huber_delta`` the Huber scale in log-loss units (None: the
        data-driven default), ``floor`` to fix c at this value (e.g. the Bayes-optimal loss)
        and fit a and b only.

    Raises:
      ValueError: a non-finite or non-positive value (the index is named), < 3 distinct C
        (2 with a fixed floor), or a floor not below every loss.
    """
    compute, loss = _check_values(compute, loss)  # errors name loss[i], not loss[0, i]
    return fit_power_law_many(compute, loss[None], **options)[0]


# --- frontiers with seeds ------------------------------------------------------------------------


def seed_bootstrap_frontier(budget, compute, seed_losses, *, n_boot: int = 1000, seed: int = 0):
    """The compute-efficient frontier of an IsoFLOP grid, and its replicates resampled over seeds.

    Args:
      budget: [K] the budget of each grid cell (a model size at a budget).
      compute: [K] the cell's training FLOPs (its seeds' mean).
      seed_losses: K arrays, the final loss of each seed of the cell.

    Each replicate redraws every cell's seeds with replacement and takes their mean, inflated by
    sqrt(n / (n - 1)) about the cell's mean (with n = 3 seeds a plain resampled mean has 2/3 of
    the variance of a mean of 3 fresh seeds; a cell of one seed does not vary), then takes, per
    budget, the best cell: so the intervals carry both the seeds' noise and the frontier's
    choice of size.

    Returns:
      (compute [B], loss [B]) of the frontier of the seed means, budgets ascending, and
      (compute [R, B], loss [R, B]) of the replicates.
    """
    budget, compute = np.asarray(budget, dtype=float), np.asarray(compute, dtype=float)
    if not (budget.shape == compute.shape == (len(seed_losses),)):
        raise ValueError("budget, compute and seed_losses need one entry per cell")
    mean_k, boot_rk = _seed_replicates(budget, seed_losses, n_boot, seed)
    cols_b = [np.flatnonzero(budget == b) for b in np.unique(budget)]

    def frontier(y_rk):
        r = np.arange(len(y_rk))
        pick = np.stack([cols[y_rk[:, cols].argmin(-1)] for cols in cols_b], -1)  # [R, B]
        return compute[pick], y_rk[r[:, None], pick]

    (c_est, y_est), (c_rb, y_rb) = frontier(mean_k[None]), frontier(boot_rk)
    return (c_est[0], y_est[0]), (c_rb, y_rb)


def _seed_replicates(budget, seed_losses, n_boot: int, seed: int):
    """Cell means [K] and replicate cell means [R, K] (see ``seed_bootstrap_frontier``)."""
    rng = np.random.default_rng(seed)
    mean_k = np.array([np.mean(v) for v in seed_losses], dtype=float)
    boot_rk = np.empty((n_boot, mean_k.size))
    for j, v in enumerate(seed_losses):
        v = np.asarray(v, dtype=float)
        if v.size == 0 or not np.all(np.isfinite(v)):
            raise ValueError(f"cell {j} (budget {budget[j]:.3g}): seed losses {v.tolist()}")
        draw = v[rng.integers(0, v.size, size=(n_boot, v.size))].mean(-1)
        scale = np.sqrt(v.size / (v.size - 1)) if v.size > 1 else 0.0
        boot_rk[:, j] = mean_k[j] + scale * (draw - mean_k[j])
    return mean_k, boot_rk


def optimal_size_seeds(
    budget, size, seed_losses, *, n_boot: int = 1000, seed: int = 0, ci: float = 0.95
) -> dict[str, Any]:
    """Compute-optimal size per budget and ``size_opt = k·C^alpha``, with intervals over seeds.

    Per budget, ``isoflop_optimum`` of the cells' seed means (a quadratic in log10 size); alpha
    by least squares over the budgets whose optimum is interior. The same seed replicates as
    ``seed_bootstrap_frontier`` (same ``seed``) give alpha's percentile interval; a replicate
    with fewer than 2 interior budgets has no alpha and is counted, not used.
    """
    budget, size = np.asarray(budget, dtype=float), np.asarray(size, dtype=float)
    mean_k, boot_rk = _seed_replicates(budget, seed_losses, n_boot, seed)
    budgets = np.unique(budget)

    def optima(y_k):
        return [isoflop_optimum(size[budget == b], y_k[budget == b]) for b in budgets]

    def alpha_of(opts):
        ok = [i for i, o in enumerate(opts) if o["interior"]]
        if len(ok) < 2:
            return np.nan, np.nan
        a, lc = np.polyfit(np.log10(budgets[ok]), np.log10([opts[i]["size_opt"] for i in ok]), 1)
        return a, 10**lc

    est = optima(mean_k)
    alpha, coef = alpha_of(est)
    boot = np.array([alpha_of(optima(y))[0] for y in boot_rk])
    valid = boot[np.isfinite(boot)]
    out: dict[str, Any] = {
        "per_budget": [{"budget": float(b), **o} for b, o in zip(budgets, est, strict=True)],
        "alpha": None if np.isnan(alpha) else float(alpha),
        "coefficient": None if np.isnan(coef) else float(coef),
        "n_interior": int(sum(o["interior"] for o in est)),
        "alpha_interval": None,
        "replicates_with_alpha": int(valid.size),
        "n_boot": n_boot,
    }
    if valid.size >= max(20, n_boot // 2):
        out["alpha_interval"] = [float(v[0]) for v in _interval(valid[:, None], ci, None)]
    else:
        out["reason"] = (
            f"{valid.size} of {n_boot} replicates have 2 budgets with an interior optimum"
        )
    return out


def fit_frontier_seeds(
    budget,
    compute,
    seed_losses,
    *,
    n_boot: int = 1000,
    seed: int = 0,
    ci: float = 0.95,
    huber_delta=None,
    floor: float | None = None,
) -> PowerLawFit:
    """L(C) fitted on an IsoFLOP grid's frontier (best seed-mean cell per budget), with
    intervals from bootstrap replicates over seeds (``seed_bootstrap_frontier``): each replicate
    frontier is refitted (same Huber δ, same floor), percentile intervals."""
    (c_b, y_b), (c_rb, y_rb) = seed_bootstrap_frontier(
        budget, compute, seed_losses, n_boot=n_boot, seed=seed
    )
    c_b, y_b = _check_values(c_b, y_b)
    floor = _check_floor(floor, np.concatenate([y_b, y_rb.ravel()]))
    need = 3 if floor is None else 2
    if c_b.size < need:
        raise ValueError(f"need at least {need} budgets to fit; got {c_b.size}")
    c0 = float(c_b.min())
    lx_b, y_log = np.log(c_b / c0), np.log(y_b)
    fl = np.array([np.nan if floor is None else floor])
    delta = (
        huber_scale(lx_b[None], y_log[None], floor_r=fl)
        if huber_delta is None
        else np.array([float(huber_delta)])
    )
    est = solve(lx_b[None], y_log[None], delta, fl)[0]
    boot = solve(np.log(c_rb / c0), np.log(y_rb), np.repeat(delta, n_boot), np.repeat(fl, n_boot))
    return _make_fit(
        est,
        boot,
        c0=c0,
        compute_max=float(c_b.max()),
        ci=ci,
        n_points=c_b.size,
        floor_fixed=floor is not None,
        huber_delta=float(delta[0]),
        resampling="seeds",
    )


def holdout_frontier_seeds(budget, compute, seed_losses, **fit_kwargs) -> dict[str, Any]:
    """``holdout_extrapolation`` for a seeded IsoFLOP grid: the top budget's cells are held out,
    the frontier of the rest fitted (``fit_frontier_seeds``), and the top budget's frontier
    (its best seed-mean cell) compared with the prediction and its band."""
    budget = np.asarray(budget, dtype=float)
    compute = np.asarray(compute, dtype=float)
    top = float(budget.max())
    held = budget == top
    means = np.array([np.mean(v) for v in seed_losses])
    best = int(np.flatnonzero(held)[means[held].argmin()])
    out: dict[str, Any] = {
        "holdout_budget": top,
        "holdout_compute": float(compute[best]),
        "observed": float(means[best]),
    }
    out |= dict.fromkeys(("predicted", "abs_error", "rel_error", "interval", "inside_interval"))
    out["fit"] = None
    keep = np.flatnonzero(~held)
    try:
        fit = fit_frontier_seeds(
            budget[keep], compute[keep], [seed_losses[i] for i in keep], **fit_kwargs
        )
    except ValueError as e:
        return out | {"reason": str(e)}
    pred = float(fit.predict(compute[best])[0])
    lo, hi = (float(v[0]) for v in fit.band(compute[best]))
    out |= {"predicted": pred, "abs_error": abs(pred - out["observed"]), "interval": (lo, hi)}
    out |= {"rel_error": abs(pred - out["observed"]) / out["observed"], "fit": fit.to_dict()}
    out["inside_interval"] = bool(lo <= out["observed"] <= hi)
    # The band is the fitted mean curve's; the observation is a mean of a few seeds with noise
    # of its own. The prediction interval adds that noise (its standard error, z at the fit's
    # level) to each half-width in quadrature.
    se, pi = prediction_interval(pred, (lo, hi), seed_losses[best], fit.ci)
    out |= {"observed_se": se, "prediction_interval": pi}
    out["inside_prediction_interval"] = bool(pi[0] <= out["observed"] <= pi[1])
    return out


def prediction_interval(pred: float, band: tuple[float, float], seed_losses, ci: float):
    """(standard error of the observed seed mean, prediction interval): ``band``, the fitted
    mean curve's interval at a point, widened by the observation's own seed noise (its
    standard error, z at level ``ci``) added to each half-width in quadrature."""
    v = np.asarray(seed_losses, dtype=float)
    se = float(np.std(v, ddof=1) / np.sqrt(v.size)) if v.size > 1 else 0.0
    z = float(stats.norm.ppf(0.5 + ci / 2))
    lo, hi = band
    return se, (
        pred - float(np.hypot(pred - lo, z * se)),
        pred + float(np.hypot(hi - pred, z * se)),
    )


def holdout_extrapolation(compute, loss, **fit_kwargs) -> dict[str, Any]:
    """Fit without the largest compute's trials, predict it, compare with their mean loss.

    ``interval`` is the band of the fitted mean curve, so it ignores the held-out trials' own noise.
    With < 3 distinct computes left, the prediction fields are None and ``reason`` says why.
    """
    compute, loss = _check_values(compute, loss)
    top = float(compute.max())
    held = compute == top
    out: dict[str, Any] = {"holdout_compute": top, "observed": float(loss[held].mean())}
    out |= dict.fromkeys(("predicted", "abs_error", "rel_error", "interval", "inside_interval"))
    out["fit"] = None
    if (left := np.unique(compute[~held]).size) < 3:
        out["reason"] = f"{left} distinct compute values below the held-out {top:.3g}; need 3"
        return out
    fit = fit_power_law(compute[~held], loss[~held], **fit_kwargs)
    pred = float(fit.predict(top)[0])
    lo, hi = (float(v[0]) for v in fit.band(top))
    out |= {"predicted": pred, "abs_error": abs(pred - out["observed"]), "interval": (lo, hi)}
    out |= {"rel_error": abs(pred - out["observed"]) / out["observed"], "fit": fit.to_dict()}
    out["inside_interval"] = bool(lo <= out["observed"] <= hi)
    return out


def isoflop_optimum(size, loss) -> dict[str, Any]:
    """Loss-minimising model size at one compute budget: quadratic in u = log10(size).

    Returns size_opt, loss_opt, coef ([q2, q1, q0] of loss ≈ q2·u² + q1·u + q0), interior (vertex
    strictly inside the sampled sizes and q2 > 0) and, when not interior, a reason; size_opt is then
    the sampled size with the lowest loss. Fewer than 3 distinct sizes: coef None and a reason.
    """
    size, loss = np.asarray(size, dtype=float), np.asarray(loss, dtype=float)
    if size.shape != loss.shape or size.ndim != 1 or not np.all(np.isfinite(loss)):
        raise ValueError(
            f"need finite size and loss of equal shape [N]; got {size.shape}, {loss.shape}"
        )
    if not np.all(np.isfinite(size) & (size > 0)):
        raise ValueError(f"sizes must be finite and > 0; got {size.tolist()}")
    i = int(loss.argmin())
    best = {"size_opt": float(size[i]), "loss_opt": float(loss[i]), "interior": False}
    if (k := np.unique(size).size) < 3:
        return best | {"coef": None, "reason": f"{k} distinct sizes; a quadratic needs 3"}
    u = np.log10(size)
    coef = np.polyfit(u, loss, 2)
    best["coef"] = coef.tolist()
    if coef[0] <= 0:
        return best | {"reason": f"curvature {coef[0]:.3g} <= 0: the fit has no minimum"}
    u_opt = -coef[1] / (2 * coef[0])
    if not u.min() < u_opt < u.max():
        return best | {"reason": f"fitted minimum at size {10**u_opt:.3g} outside sampled range"}
    opt = {"size_opt": float(10**u_opt), "loss_opt": float(np.polyval(coef, u_opt))}
    return best | opt | {"interior": True}


def fit_optimal_size_law(budgets, sizes_opt) -> dict[str, Any]:
    """size_opt = coefficient·C^alpha by least squares in log-log.

    NaN sizes (budgets without an interior optimum) are skipped; ≥ 2 distinct budgets must remain,
    else alpha and coefficient are None and ``reason`` says why.
    """
    budgets, sizes_opt = np.asarray(budgets, dtype=float), np.asarray(sizes_opt, dtype=float)
    keep = np.isfinite(sizes_opt)
    budgets, sizes_opt = budgets[keep], sizes_opt[keep]
    if np.any(~np.isfinite(budgets) | (budgets <= 0) | (sizes_opt <= 0)):
        raise ValueError("budgets and sizes must be finite and > 0")
    out: dict[str, Any] = {"alpha": None, "coefficient": None, "n_points": int(keep.sum())}
    if (k := np.unique(budgets).size) < 2:
        return out | {"reason": f"{k} distinct budgets; need 2"}
    alpha, log_coef = np.polyfit(np.log10(budgets), np.log10(sizes_opt), 1)
    return out | {"alpha": float(alpha), "coefficient": float(10**log_coef)}
