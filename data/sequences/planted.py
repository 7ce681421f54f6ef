"""Stateless planted sequential data: user histories whose next item depends on their order,
with the exact Bayes-optimal next-item loss known.

Every history is a pure function of ``(cfg, seed, user index)`` (counter-based randomness,
``data.counter_rng``, as ``data/synthetic.py``): a step of training reads the same users whether
it ran straight through or resumed. Training users are indices ``[0, 2**62)``; held-out user
``j`` is ``EVAL_INDEX_OFFSET + j``.

Shapes (dimension glossary): ``V`` items (ids ``1..V``, 0 is padding), ``C`` tastes, ``K``
successors per item, ``B`` users of a call, ``L`` positions (``max_len``).

The process. Items have a Zipf popularity ``pop(j) ~ (rank + 1)^-s`` (ranks mapped to items by a
seeded affine bijection) and a seeded taste group ``g(j)`` in ``0..C-1``. User ``u`` has a latent
taste ``c_u`` (uniform over ``C``) and a length uniform on ``[min_len, max_len]``. Item ``x_t``
is drawn from the mixture

    p(x_t = j | x_<t, c) = a_taste(t) taste_c(j) + a_trans(t) sum_k q_k [succ(x_{t-1}, k) = j]
                           + a_lag(t) [echo(x_{t-lag}) = j]

* ``taste_c(j) = pop(j) (1 + (boost - 1) [g(j) = c]) / Z_c``: popularity tilted to the user's
  group (``Z_c = 1 + (boost - 1) P_c``, ``P_c`` the group's popularity mass). A bag of the
  user's items reveals ``c``, so a bag model can learn this part.
* ``succ(i, k)``: ``K`` seeded successors of item ``i`` (drawn by popularity), weights
  ``q_k ~ successor_decay^k``: a sparse first-order transition table; only the order tells which
  item was last.
* ``echo(i)``: one seeded item (drawn by popularity) that follows ``i`` exactly ``lag`` steps
  later: a longer-range dependency.
* ``(a_taste, a_trans, a_lag)`` is ``cfg.mix`` renormalised over the parts that exist at ``t``:
  taste alone at ``t = 0``, no lag part before ``t = lag``.

Since ``c_u`` is latent, the best predictor from the history alone (the Bayes-optimal one) is
``p(x_t | x_<t) = sum_c post(c | x_<t) p(x_t | x_<t, c)``, with the exact posterior
``post(c | x_<t) ~ prod_{s<t} p(x_s | x_<s, c)`` (uniform prior): O(C) per position.
:meth:`PlantedSequences.losses` reports the mean of ``-log p`` over positions ``t >= 1`` of a set
of histories (nats) for that predictor (``bayes``), for one that also knows ``c_u``
(``taste_known``, a lower bound no model of the history reaches), and for baselines, each mixed
with a unigram ``u(j)`` counted on training histories (add-1/2 smoothing) for the parts it cannot
see: ``unigram`` alone; ``last_item``, the planted transition table applied to the last item
(``a_trans(t) T(x_{t-1}, .) + (1 - a_trans(t)) u``); ``bag``, the taste part with the posterior
of ``c`` from the bag of past items under taste alone (order-free:
``a_taste(t) sum_c post_bag(c) taste_c + (1 - a_taste(t)) u``). The gap from ``bag`` to
``bayes`` is headroom only an order-aware model can take.

Default config (``PlantedConfig()``, seed 0, the 2,048 held-out users, unigram from 4,096
training users), nats per position: bayes 3.56, taste_known 3.53, last_item 5.14, bag 5.96,
unigram 6.45 (log V = 9.21); seed 1: 3.52, 3.49, 5.06, 5.82, 6.32.
``tests/data/sequences/test_planted.py`` checks on a small config that the mean ``-log p`` of
sampled items equals the mean exact entropy of the predictive distributions within sampling
error (the sampler draws from the distributions the scorer computes), and that ``bayes`` is
below every baseline.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from data import counter_rng as rng
from data.sequences.histories import Histories, HistoryCounters

EVAL_INDEX_OFFSET = 2**62
"""Held-out user ``j`` is index ``EVAL_INDEX_OFFSET + j``; training users are ``[0, 2**62)``."""

_S_SEED, _S_PERM, _S_GROUP, _S_SUCC, _S_ECHO, _S_USER, _S_STEP = range(1, 8)
_DENSE_MAX = 2**24  # largest C * V for the dense predictive distributions (entropies)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlantedConfig:
    """A planted sequential process (``data/sequences/planted.py``)."""

    n_items: int = 10_000
    """V: item ids are ``1..V``."""
    zipf_exponent: float = 1.0
    """Popularity skew: ``pop(rank) ~ (rank + 1)^-s``; 0 is uniform."""
    num_tastes: int = 32
    """C: latent user tastes (item groups)."""
    taste_boost: float = 100.0
    """How much likelier a user's own group's items are in the taste part (>= 1)."""
    num_successors: int = 4
    """K: successors per item in the transition part."""
    successor_decay: float = 0.5
    """Successor weights ``q_k ~ decay^k``."""
    lag: int = 4
    """The echo part follows the item this many steps back (>= 2: 1 is the transition's)."""
    mix: tuple[float, float, float] = (0.4, 0.4, 0.2)
    """Weights of the (taste, transition, lag) parts where all exist."""
    min_len: int = 20
    """Shortest history."""
    max_len: int = 100
    """Longest history (L)."""
    num_eval_users: int = 2048
    """Held-out users (``EVAL_INDEX_OFFSET + j`` for ``j < num_eval_users``)."""

    def __post_init__(self):
        if not 1 <= self.n_items < 2**31:
            raise ValueError(f"PlantedConfig.n_items must be in [1, 2**31), got {self.n_items}")
        if not (math.isfinite(self.zipf_exponent) and self.zipf_exponent >= 0):
            raise ValueError(f"PlantedConfig.zipf_exponent must be >= 0, got {self.zipf_exponent}")
        if self.num_tastes < 1 or self.num_successors < 1:
            raise ValueError("PlantedConfig.num_tastes and num_successors must be >= 1")
        if not self.taste_boost >= 1.0:
            raise ValueError(f"PlantedConfig.taste_boost must be >= 1, got {self.taste_boost}")
        if not 0.0 < self.successor_decay <= 1.0:
            raise ValueError("PlantedConfig.successor_decay must be in (0, 1]")
        if self.lag < 2:
            raise ValueError(f"PlantedConfig.lag must be >= 2, got {self.lag}")
        if len(self.mix) != 3 or min(self.mix) < 0 or self.mix[0] <= 0:
            raise ValueError(f"PlantedConfig.mix must be 3 weights >= 0, taste > 0: {self.mix}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError("PlantedConfig needs 1 <= min_len <= max_len")
        if not 0 <= self.num_eval_users <= 2**61:
            raise ValueError("PlantedConfig.num_eval_users must be in [0, 2**61]")


class PlantedSequences:
    """Index-based planted histories and their exact conditionals (module docstring)."""

    def __init__(self, cfg: PlantedConfig, seed: int):
        self.cfg, self.seed = cfg, int(seed)
        v, c, k, s = cfg.n_items, cfg.num_tastes, cfg.num_successors, self.seed
        ranks = np.arange(v, dtype=np.float64)
        w = np.power(ranks + 1.0, -cfg.zipf_exponent)
        a = rng.coprime_multiplier(v, rng.salt(_S_PERM, s, 0))
        b = rng.salt(_S_PERM, s, 1) % v
        self.pop = np.zeros(v + 1)  # [V + 1], pop[0] = 0 (padding)
        self.pop[(a * np.arange(v, dtype=np.int64) + b) % v + 1] = w / w.sum()
        items = np.arange(1, v + 1, dtype=np.uint64)
        self.group = np.full(v + 1, -1, np.int64)  # [V + 1]
        self.group[1:] = (rng.mix(items ^ np.uint64(rng.salt(_S_GROUP, s))) % np.uint64(c)).astype(
            np.int64
        )
        self.group_mass = np.bincount(self.group[1:], weights=self.pop[1:], minlength=c)  # P_c
        self.z = 1.0 + (cfg.taste_boost - 1.0) * self.group_mass  # [C]
        self._pop_cdf = np.cumsum(self.pop[1:])
        # Items sorted by group, and the cumulative popularity in that order: group c's items
        # are the segment [gstart[c], gstart[c + 1]).
        self._by_group = np.argsort(self.group[1:], kind="stable") + 1
        self._group_cdf = np.cumsum(self.pop[self._by_group])
        self._group_start = np.concatenate(
            [[0], np.cumsum(np.bincount(self.group[1:], minlength=c))]
        )
        self._group_base = np.concatenate([[0.0], np.cumsum(self.group_mass)])
        q = cfg.successor_decay ** np.arange(k)
        self.q = q / q.sum()  # [K]
        self._q_cdf = np.cumsum(self.q)
        kk = np.arange(k, dtype=np.uint64)
        h = rng.mix(
            (items[:, None] * rng.U64_GOLDEN + kk[None, :]) ^ np.uint64(rng.salt(_S_SUCC, s))
        )
        self.succ = np.zeros((v + 1, k), np.int32)  # [V + 1, K]; row 0 unused
        self.succ[1:] = self._sample_pop(rng.uniform(h))
        self.echo = np.zeros(v + 1, np.int32)  # [V + 1]
        self.echo[1:] = self._sample_pop(
            rng.uniform(rng.mix(items * rng.U64_GOLDEN ^ np.uint64(rng.salt(_S_ECHO, s))))
        )
        self._seed_key = np.uint64(rng.salt(_S_SEED, s))
        self._step_salts = np.array(
            [[rng.salt(_S_STEP, s, t, j) for j in range(3)] for t in range(cfg.max_len)], np.uint64
        )  # [L, 3]
        self._user_salts = np.array([rng.salt(_S_USER, s, j) for j in range(2)], np.uint64)
        mix = np.asarray(cfg.mix, np.float64)
        t = np.arange(cfg.max_len)
        parts = mix[None, :] * np.stack([t >= 0, t >= 1, t >= cfg.lag], axis=1)
        self.weights = parts / parts.sum(axis=1, keepdims=True)  # [L, 3]: a(t) per part

    # ----------------------------------------------------------------------------- sampling

    def _sample_pop(self, u: np.ndarray) -> np.ndarray:
        """Items (int32, ``1..V``) with probability ``pop`` from uniforms ``u``."""
        idx = np.searchsorted(self._pop_cdf, u * self._pop_cdf[-1], side="right")
        return (np.minimum(idx, self.cfg.n_items - 1) + 1).astype(np.int32)

    def _sample_group(self, c: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Items of group ``c`` with probability proportional to ``pop``, from uniforms ``u``."""
        target = self._group_base[c] + u * self.group_mass[c]
        pos = np.searchsorted(self._group_cdf, target, side="right")
        pos = np.clip(pos, self._group_start[c], self._group_start[c + 1] - 1)
        return self._by_group[pos].astype(np.int32)

    def user_keys(self, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
            raise ValueError(f"indices must be a 1-D integer array, got {idx.shape} {idx.dtype}")
        if idx.size and idx.min() < 0:
            raise ValueError(f"indices must be >= 0, got {int(idx.min())}")
        return rng.mix(idx.astype(np.uint64) * rng.U64_GOLDEN + self._seed_key)

    def user_latents(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(taste int64 [B], length int64 [B])`` of users ``indices``."""
        keys = self.user_keys(indices)
        cfg = self.cfg
        taste = (rng.mix(keys ^ self._user_salts[0]) % np.uint64(cfg.num_tastes)).astype(np.int64)
        span = np.uint64(cfg.max_len - cfg.min_len + 1)
        length = (rng.mix(keys ^ self._user_salts[1]) % span).astype(np.int64) + cfg.min_len
        return taste, length

    def sample(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(items int32 [B, L] with 0 past each length, lengths int64 [B])`` of users
        ``indices``: a pure function of (cfg, seed, index)."""
        keys = self.user_keys(indices)
        taste, length = self.user_latents(indices)
        n, cfg = keys.shape[0], self.cfg
        x = np.zeros((n, cfg.max_len), np.int32)
        for t in range(int(length.max(initial=0))):
            u = rng.uniform(rng.mix(keys[:, None] ^ self._step_salts[t][None, :]))  # [B, 3]
            a = self.weights[t]
            # Taste part: with probability 1 / Z_c plain popularity, else the user's group.
            from_pop = u[:, 2] * self.z[taste] < 1.0
            item = np.where(from_pop, self._sample_pop(u[:, 1]), self._sample_group(taste, u[:, 1]))
            if t >= 1:
                k = np.minimum(np.searchsorted(self._q_cdf, u[:, 1], side="right"), len(self.q) - 1)
                item = np.where(u[:, 0] >= a[0], self.succ[x[:, t - 1], k], item)
            if t >= cfg.lag:
                item = np.where(u[:, 0] >= a[0] + a[1], self.echo[x[:, t - cfg.lag]], item)
            x[:, t] = np.where(t < length, item, 0)
        return x, length

    def histories(self, indices: np.ndarray) -> Histories:
        """The histories of users ``indices`` (``user_raw`` = the indices; vocabulary
        ``1..V``)."""
        idx = np.asarray(indices, np.int64)
        x, length = self.sample(idx)
        mask = np.arange(self.cfg.max_len)[None, :] < length[:, None]
        t = int(length.sum())
        return Histories(
            items=x[mask].astype(np.int32),
            offsets=np.concatenate([[0], np.cumsum(length)]).astype(np.int64),
            user_raw=idx,
            item_raw=np.arange(1, self.cfg.n_items + 1, dtype=np.int64),
            counters=HistoryCounters(events_read=t, events_kept=t),
        )

    def train_histories(self, start: int, count: int) -> Histories:
        """Training users ``[start, start + count)``."""
        if start < 0 or count < 0 or start + count > EVAL_INDEX_OFFSET:
            raise ValueError(f"training users are [0, 2**62); got [{start}, {start + count})")
        return self.histories(np.arange(start, start + count, dtype=np.int64))

    def eval_histories(self) -> Histories:
        """The ``cfg.num_eval_users`` held-out users."""
        return self.histories(EVAL_INDEX_OFFSET + np.arange(self.cfg.num_eval_users))

    # ----------------------------------------------------------------------------- scoring

    def _padded(self, hist: Histories) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lengths = hist.lengths()
        if lengths.size and lengths.max() > self.cfg.max_len:
            raise ValueError(f"histories longer than max_len = {self.cfg.max_len}")
        if hist.n_items != self.cfg.n_items:
            raise ValueError(f"histories over {hist.n_items} items, not {self.cfg.n_items}")
        mask = np.arange(self.cfg.max_len)[None, :] < lengths[:, None]
        x = np.zeros(mask.shape, np.int32)
        x[mask] = hist.items
        return x, lengths, mask

    def _taste_prob(self, x: np.ndarray) -> np.ndarray:
        """float64 [B, C]: ``taste_c(x_b)`` for items ``x`` [B]."""
        c = np.arange(self.cfg.num_tastes)
        own = self.group[x][:, None] == c[None, :]
        return self.pop[x][:, None] * (1.0 + (self.cfg.taste_boost - 1.0) * own) / self.z[None, :]

    def _sequential(self, x: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        """``(trans, lag)`` float64 [B]: ``T(x_{t-1}, x_t)`` and ``[echo(x_{t-lag}) = x_t]``."""
        cur = x[:, t]
        trans = np.zeros(cur.shape)
        if t >= 1:
            trans = ((self.succ[x[:, t - 1]] == cur[:, None]) * self.q[None, :]).sum(axis=1)
        lag = np.zeros(cur.shape)
        if t >= self.cfg.lag:
            lag = (self.echo[x[:, t - self.cfg.lag]] == cur).astype(np.float64)
        return trans, lag

    def log_probs(self, hist: Histories, *, tastes: np.ndarray | None = None) -> np.ndarray:
        """float64 [T]: ``log p(x_t | x_<t)`` of every event, the Bayes-optimal predictor of the
        history (taste marginalised); with ``tastes`` (int [U], each user's ``c_u``), the
        predictor that knows the taste instead."""
        x, lengths, mask = self._padded(hist)
        n, c = x.shape[0], self.cfg.num_tastes
        logpost = np.zeros((n, c))
        out = np.zeros(x.shape)
        for t in range(int(lengths.max(initial=0))):
            a = self.weights[t]
            trans, lag = self._sequential(x, t)
            p_c = a[0] * self._taste_prob(x[:, t]) + (a[1] * trans + a[2] * lag)[:, None]
            if tastes is None:
                post = np.exp(logpost - logpost.max(axis=1, keepdims=True))
                post /= post.sum(axis=1, keepdims=True)
                out[:, t] = _log(mask[:, t], (post * p_c).sum(axis=1))
            else:
                out[:, t] = _log(mask[:, t], p_c[np.arange(n), tastes])
            logpost += np.log(np.where(mask[:, t : t + 1], p_c, 1.0))
        return out[mask]

    def entropies(self, hist: Histories) -> np.ndarray:
        """float64 [T]: the exact entropy of ``p(. | x_<t)`` at every event (dense over ``V``:
        for small configs, ``C * V <= 2**24``)."""
        cfg = self.cfg
        v, c = cfg.n_items, cfg.num_tastes
        if c * v > _DENSE_MAX:
            raise ValueError(f"entropies: C * V = {c * v} is too large for dense distributions")
        x, lengths, mask = self._padded(hist)
        n = x.shape[0]
        items = np.arange(1, v + 1)
        taste_cv = self._taste_prob(items).T  # [C, V]
        logpost = np.zeros((n, c))
        out = np.zeros(x.shape)
        rows = np.arange(n)
        for t in range(int(lengths.max(initial=0))):
            a = self.weights[t]
            post = np.exp(logpost - logpost.max(axis=1, keepdims=True))
            post /= post.sum(axis=1, keepdims=True)
            p = a[0] * post @ taste_cv  # [B, V], item j at column j - 1
            if t >= 1:
                # One successor slot at a time: each row gets one column, so ``+=`` on the fancy
                # index adds every weight (repeated successors of a row land in different k).
                for k in range(cfg.num_successors):
                    p[rows, self.succ[x[:, t - 1], k] - 1] += a[1] * self.q[k]
            if t >= cfg.lag:
                p[rows, self.echo[x[:, t - cfg.lag]] - 1] += a[2]
            out[:, t] = -(p * np.log(p)).sum(axis=1)
            trans, lag = self._sequential(x, t)
            p_c = a[0] * self._taste_prob(x[:, t]) + (a[1] * trans + a[2] * lag)[:, None]
            logpost += np.log(np.where(mask[:, t : t + 1], p_c, 1.0))
        return out[mask]

    def losses(self, hist: Histories, train: Histories) -> dict[str, float]:
        """Mean next-item cross-entropy (nats) over positions ``t >= 1`` of ``hist``, of the
        Bayes-optimal predictor and the baselines (module docstring); ``train`` gives the
        unigram (use training users, e.g. :meth:`train_histories`)."""
        cfg = self.cfg
        counts = np.bincount(train.items, minlength=cfg.n_items + 1)[1:] + 0.5
        uni = np.concatenate([[0.0], counts / counts.sum()])  # [V + 1]
        x, lengths, mask = self._padded(hist)
        n, c = x.shape[0], cfg.num_tastes
        scored = mask.copy()
        scored[:, 0] = False
        bag_logpost = np.zeros((n, c))
        out = {k: np.zeros(x.shape) for k in ("unigram", "last_item", "bag")}
        for t in range(int(lengths.max(initial=0))):
            a = self.weights[t]
            cur = x[:, t]
            tp = self._taste_prob(cur)  # [B, C]
            m = mask[:, t]
            out["unigram"][:, t] = _log(m, uni[cur])
            trans, _ = self._sequential(x, t)
            out["last_item"][:, t] = _log(m, a[1] * trans + (1.0 - a[1]) * uni[cur])
            post = np.exp(bag_logpost - bag_logpost.max(axis=1, keepdims=True))
            post /= post.sum(axis=1, keepdims=True)
            out["bag"][:, t] = _log(m, a[0] * (post * tp).sum(axis=1) + (1.0 - a[0]) * uni[cur])
            bag_logpost += np.log(np.where(mask[:, t : t + 1], tp, 1.0))
        res = {
            "bayes": -float(self.log_probs(hist)[scored[mask]].mean()),
            "taste_known": -float(
                self.log_probs(hist, tastes=self.user_latents(hist.user_raw)[0])[
                    scored[mask]
                ].mean()
            ),
        }
        res.update({k: -float(v[scored].mean()) for k, v in out.items()})
        res["log_n_items"] = math.log(cfg.n_items)
        return res


def _log(mask: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``log p`` where ``mask``, 0 elsewhere (padding positions have ``p = 0``)."""
    return np.log(np.where(mask, p, 1.0))
