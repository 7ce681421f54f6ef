"""A learned cost model of a device's embedding work (NeuroShard, MLSys 2023), trained on
measured shard sets (``benchmarks/cost_table.py``).

The model predicts the log of one device's step time (pool + fused backward/update of all its
shards, ``shard_cost.measure``) from its shards, NeuroShard's form: each shard's features
(:func:`shard_features`) encoded by a small MLP, the encodings summed over the device's shards
(so a device's cost is not the sum of its shards' single costs: the head sees how many tables
share the caches and kernel calls) and squashed by ``log1p``, then a head MLP over that and the
device's own features (:func:`device_features`: shard and buffer counts, bytes, lookups, the
bags' padding). Trained with optax AdamW on the squared error of log seconds (MSE of logs is a
relative error), over the cost table's tasks but a held-out fifth (split by task, so no device
set of a held-out task is seen); five such nets from different seeds, their mean log time the
prediction (a search exploits one net's errors; an ensemble's are smaller and rarer).

Beside it, the **analytic** model the planner uses (``planner.candidates``): lookup bytes over
the memory bandwidth times the lookup factor, plus FLOPs over the peak; its factor fitted to the
same training samples (least squares through the origin, as ``CostModel.calibrated`` fits it).
``python -m recscale.embeddings.fit_cost_model TABLE --out MODEL.npz`` trains, saves
and prints both models' held-out error (MAPE) and rank correlation.

A saved model is one ``.npz`` of float arrays and a JSON string (loaded with
``allow_pickle=False``: nothing in it is executed); a missing, corrupt or changed model file is
a ``ConfigError`` (the CLIs print one line naming it). :class:`CostPredictor` evaluates it in numpy
(the planner's search calls it thousands of times; a jitted call's dispatch would dominate).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from pathlib import Path

import numpy as np

from recscale.config_io import ConfigError
from recscale.embeddings import planner
from recscale.embeddings.shard_cost import KINDS, ShardWork, distinct_share, valid_share

MODELS_DIR = Path(__file__).resolve().parent / "cost_models"
"""Models shipped with the package, one per hardware profile (``<profile>.npz``)."""
SHARD_FEATURES = 10 + len(KINDS)
DEVICE_FEATURES = 6
LAYERS = ("enc1", "enc2", "head1", "head2", "out")
WEIGHTS = ("x_mean", "x_std", "d_mean", "d_std", "y_mean", "y_std") + tuple(
    f"{name}_{part}" for name in LAYERS for part in "wb"
)
"""The arrays of a saved model."""


def shard_features(s: ShardWork, pad: int) -> np.ndarray:
    """One shard's inputs: log sizes (rows, width, bags, ids per bag, padded id slots, bytes,
    expected valid lookups, and the distinct rows among them), the share of the table's ids it
    holds, the skew, and its kind (one-hot)."""
    share = valid_share(s)
    lookups = s.bags * s.hotness * share
    distinct = distinct_share(s.table_rows, s.zipf, max(1, int(s.bags * s.hotness)))
    kind = np.zeros(len(KINDS))
    kind[KINDS.index(s.kind)] = 1
    head = [
        math.log2(s.rows),
        math.log2(s.width),
        math.log2(s.bags),
        math.log2(s.hotness),
        math.log2(s.bags * max(pad, s.hotness)),
        math.log2(s.bytes),
        math.log2(lookups + 1),
        math.log2(lookups * distinct + 1),
        share,
        s.zipf,
    ]
    return np.concatenate([np.asarray(head), kind])


def device_features(shards: list[ShardWork], pad: int) -> np.ndarray:
    buffers = {(s.width, s.replicated) for s in shards}
    lookups = sum(s.bags * s.hotness * valid_share(s) for s in shards)
    return np.array(
        [
            math.log2(len(shards) + 1),
            math.log2(len(buffers) + 1),
            math.log2(sum(s.bytes for s in shards) + 1),
            math.log2(max(pad, 1)),
            math.log2(lookups + 1),
            math.log2(sum(s.bags * max(pad, s.hotness) for s in shards) + 1),
        ]
    )


# ------------------------------------------------------------------------------------------------
# The cost table.


@dataclasses.dataclass(frozen=True)
class Sample:
    task: str
    pad: int
    shards: tuple[ShardWork, ...]
    seconds: float


def load_table(path: str | Path) -> tuple[dict, list[Sample]]:
    """``(header, samples)`` of a cost table (``benchmarks/cost_table.py``); a malformed line
    raises naming the file and line."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the cost table ({e})") from None
    if not lines:
        raise ValueError(f"{path}: empty cost table")
    try:
        header = json.loads(lines[0])
        if not isinstance(header, dict) or "version" not in header:
            raise ValueError("no version")
    except ValueError as e:
        raise ValueError(f"{path}:1: not a cost-table header ({e})") from None
    out = []
    for i, line in enumerate(lines[1:], start=2):
        try:
            r = json.loads(line)
            shards = tuple(
                ShardWork(
                    table_rows=int(a[0]),
                    rows=int(a[1]),
                    row_start=int(a[2]),
                    width=int(a[3]),
                    bags=int(a[4]),
                    hotness=int(a[5]),
                    zipf=float(a[6]),
                    kind=str(a[7]),
                )
                for a in r["shards"]
            )
            seconds = float(r["seconds"])
            if not shards or not seconds > 0:
                raise ValueError("no shards or a non-positive time")
            out.append(Sample(str(r["task"]), int(r["pad"]), shards, seconds))
        except (ValueError, KeyError, TypeError, IndexError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}:{i}: bad cost-table sample ({e})") from None
    return header, out


def split_by_task(samples: list[Sample], held_out: float = 0.2, seed: int = 0):
    """``(train, held-out)``: a random ``held_out`` share of the tasks held out whole."""
    tasks = sorted({s.task for s in samples})
    rng = np.random.default_rng(seed)
    test = set(rng.permutation(tasks)[: max(1, round(held_out * len(tasks)))].tolist())
    return [s for s in samples if s.task not in test], [s for s in samples if s.task in test]


def _arrays(samples: list[Sample]):
    """``x [N, S, F]``, ``mask [N, S]``, ``dev [N, G]`` and ``y [N]`` (log seconds)."""
    s_max = max(len(s.shards) for s in samples)
    x = np.zeros((len(samples), s_max, SHARD_FEATURES), np.float32)
    mask = np.zeros((len(samples), s_max), np.float32)
    dev = np.zeros((len(samples), DEVICE_FEATURES), np.float32)
    for i, smp in enumerate(samples):
        for j, sh in enumerate(smp.shards):
            x[i, j] = shard_features(sh, smp.pad)
        mask[i, : len(smp.shards)] = 1
        dev[i] = device_features(list(smp.shards), smp.pad)
    y = np.log(np.array([s.seconds for s in samples], np.float32))
    return x, mask, dev, y


# ------------------------------------------------------------------------------------------------
# The model: trained in flax, evaluated in numpy.


def _net(hidden: int, seed: int):
    from flax import nnx  # noqa: PLC0415

    class CostNet(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.enc1 = nnx.Linear(SHARD_FEATURES, hidden, rngs=rngs)
            self.enc2 = nnx.Linear(hidden, hidden, rngs=rngs)
            self.head1 = nnx.Linear(hidden + DEVICE_FEATURES, hidden, rngs=rngs)
            self.head2 = nnx.Linear(hidden, hidden, rngs=rngs)
            self.out = nnx.Linear(hidden, 1, rngs=rngs)

        def __call__(self, x, mask, dev):
            import jax.numpy as jnp  # noqa: PLC0415

            e = nnx.relu(self.enc2(nnx.relu(self.enc1(x))))
            pooled = jnp.log1p((e * mask[..., None]).sum(-2))
            h = nnx.relu(self.head1(jnp.concatenate([pooled, dev], -1)))
            h = nnx.relu(self.head2(h))
            return self.out(h)[..., 0]

    return CostNet(nnx.Rngs(seed))


@dataclasses.dataclass
class CostPredictor:
    """A trained model (numpy weights and the input/target normalisation)."""

    weights: dict[str, np.ndarray]
    meta: dict

    @property
    def encoding_shape(self) -> tuple[int, int]:
        """``(K, H)``: the ensemble's members and each one's encoding width."""
        return self.weights["enc2_b"].shape

    def encode(self, feats: np.ndarray) -> np.ndarray:
        """``[..., F]`` shard features -> ``[..., K, H]`` encodings (summed per device)."""
        w = self.weights
        x = (feats - w["x_mean"]) / w["x_std"]
        h = np.maximum(np.einsum("...f,kfh->...kh", x, w["enc1_w"]) + w["enc1_b"], 0)
        return np.maximum(np.einsum("...kf,kfh->...kh", h, w["enc2_w"]) + w["enc2_b"], 0)

    def head(self, pooled_sum: np.ndarray, dev: np.ndarray) -> np.ndarray:
        """Seconds ``[...]`` of devices with encoding sums ``[..., K, H]`` and device features
        ``[..., G]``: the members' mean log time."""
        w = self.weights
        d = (dev - w["d_mean"]) / w["d_std"]
        d = np.broadcast_to(d[..., None, :], pooled_sum.shape[:-1] + d.shape[-1:])
        h = np.concatenate([np.log1p(pooled_sum), d], -1)
        h = np.maximum(np.einsum("...kf,kfh->...kh", h, w["head1_w"]) + w["head1_b"], 0)
        h = np.maximum(np.einsum("...kf,kfh->...kh", h, w["head2_w"]) + w["head2_b"], 0)
        y = (np.einsum("...kf,kfh->...kh", h, w["out_w"]) + w["out_b"])[..., 0].mean(-1)
        return np.exp(y * float(w["y_std"]) + float(w["y_mean"]))

    def seconds(self, shards: list[ShardWork], pad: int) -> float:
        """One device's predicted step time (0 without shards)."""
        if not shards:
            return 0.0
        enc = self.encode(np.stack([shard_features(s, pad) for s in shards])).sum(0)
        return float(self.head(enc, device_features(shards, pad)))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, meta=np.asarray(json.dumps(self.meta)), **self.weights)

    @classmethod
    def load(cls, path: str | Path) -> CostPredictor:
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                weights = {k: np.asarray(z[k]) for k in z.files if k != "meta"}
                meta = json.loads(str(z["meta"]))
        except Exception as e:  # noqa: BLE001 (zip, pickle-refusal, JSON, EOF: all "not a model")
            raise ConfigError(
                f"{path}: not a learned cost model ({type(e).__name__}: {e})"
            ) from None
        missing = sorted(set(WEIGHTS) - set(weights))
        if missing or meta.get("features") != SHARD_FEATURES:
            raise ConfigError(
                f"{path}: not a learned cost model of this version (missing {missing}, "
                f"{meta.get('features')} shard features against {SHARD_FEATURES})"
            )
        return cls(weights, meta)

    @classmethod
    def for_profile(cls, profile: str, path: str | Path = "", digest: str = "") -> CostPredictor:
        """The model at ``path``, or the one shipped for ``profile``; one-line error if none,
        or if ``digest`` is given and the file's differs (:func:`file_digest`)."""
        p = model_path(profile, path)
        if not p.is_file():
            raise ConfigError(
                f"no learned cost model for profile {profile!r} ({p} does not exist): measure a "
                "cost table on that hardware (python benchmarks/cost_table.py) and train one "
                "(python -m recscale.embeddings.fit_cost_model TABLE --out MODEL.npz), then "
                "pass --embeddings.cost-model-path MODEL.npz"
            )
        if digest and file_digest(p) != digest:
            raise ConfigError(
                f"{p}: the learned cost model changed since this run planned with it (digest "
                f"{file_digest(p)}, recorded {digest}); its plan would differ: restore that "
                "file or start a new run"
            )
        return cls.load(p)


def model_path(profile: str, path: str | Path = "") -> Path:
    """``path``, or the model shipped for ``profile``."""
    return Path(path) if path else MODELS_DIR / f"{profile}.npz"


def file_digest(path: str | Path) -> str:
    """The first 16 hex digits of a file's SHA-256."""
    import hashlib  # noqa: PLC0415

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def train(
    samples: list[Sample],
    *,
    hidden: int = 64,
    steps: int = 4000,
    batch: int = 256,
    seed: int = 0,
    members: int = 5,
) -> CostPredictor:
    """Fits the model to ``samples`` (see the module docstring): an ensemble of ``members``
    nets from seeds ``seed, seed + 1, ...``, predicting their mean log time (one net fits the
    training sets well below the timings' own noise and misses held-out tasks by more; the
    mean of several varies less)."""
    import jax  # noqa: PLC0415

    x, mask, dev, y = _arrays(samples)
    flat = x[mask > 0]
    norm = {
        "x_mean": flat.mean(0),
        "x_std": flat.std(0) + 1e-3,
        "d_mean": dev.mean(0),
        "d_std": dev.std(0) + 1e-3,
        "y_mean": np.float32(y.mean()),
        "y_std": np.float32(y.std() + 1e-3),
    }
    xn = (x - norm["x_mean"]) / norm["x_std"] * mask[..., None]
    dn = (dev - norm["d_mean"]) / norm["d_std"]
    yn = (y - norm["y_mean"]) / norm["y_std"]
    weights = {k: np.asarray(v, np.float32) for k, v in norm.items()}
    nets = []
    for i in range(members):
        nets.append(_fit(_net(hidden, seed + i), xn, mask, dn, yn, steps, batch, seed + i))
    for name in LAYERS:
        for part, attr in (("w", "kernel"), ("b", "bias")):
            weights[f"{name}_{part}"] = np.stack(
                [np.asarray(jax.device_get(getattr(getattr(m, name), attr)[...])) for m in nets]
            ).astype(np.float32)
    meta = {
        "hidden": hidden,
        "steps": steps,
        "members": members,
        "samples": len(samples),
        "features": SHARD_FEATURES,
    }
    return CostPredictor(weights, meta)


def _fit(model, xn, mask, dn, yn, steps: int, batch: int, seed: int):
    """``model`` trained by optax AdamW (cosine decay) on minibatches of the arrays."""
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    schedule = optax.cosine_decay_schedule(3e-3, steps)
    opt = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=1e-4), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, xb, mb, db, yb):
        def loss_fn(m):
            return jnp.mean(jnp.square(m(xb, mb, db) - yb))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    n = yn.shape[0]
    for _ in range(steps):
        idx = rng.integers(0, n, min(batch, n))
        step(model, opt, xn[idx], mask[idx], dn[idx], yn[idx])
    return model


# ------------------------------------------------------------------------------------------------
# The analytic model, and the comparison.


def analytic_terms(s: ShardWork, profile) -> tuple[float, float]:
    """``(lookup seconds at factor 1, compute seconds)`` of a shard: the planner's formula
    (``planner.lookup_terms``) for the share of its bags' ids it serves, float32 storage (the
    cost table's)."""
    lookups = s.bags * s.hotness * valid_share(s)
    return planner.lookup_terms(lookups, s.width, 4, profile, planner.CostModel())


def analytic_device(shards, profile, factor: float) -> float:
    terms = [analytic_terms(s, profile) for s in shards]
    return sum(factor * a + b for a, b in terms)


def fit_analytic(samples: list[Sample], profile) -> float:
    """The lookup factor (least squares through the origin of the lookup term against the
    measured time less the compute term)."""
    a = np.array([sum(analytic_terms(s, profile)[0] for s in smp.shards) for smp in samples])
    b = np.array([sum(analytic_terms(s, profile)[1] for s in smp.shards) for smp in samples])
    y = np.array([smp.seconds for smp in samples])
    return float(a @ (y - b) / (a @ a))


def mape(pred, true) -> float:
    pred, true = np.asarray(pred, float), np.asarray(true, float)
    return float(np.mean(np.abs(pred - true) / true))


def spearman(a, b) -> float:
    """Rank correlation (ties broken by position: measured times have none)."""
    ra = np.argsort(np.argsort(np.asarray(a, float))).astype(float)
    rb = np.argsort(np.argsort(np.asarray(b, float))).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def evaluate(model: CostPredictor, factor: float, samples: list[Sample], profile) -> dict:
    """Held-out MAPE and rank correlation (over device sets) of both models."""
    y = np.array([s.seconds for s in samples])
    learned = np.array([model.seconds(list(s.shards), s.pad) for s in samples])
    analytic = np.array([analytic_device(s.shards, profile, factor) for s in samples])
    return {
        "samples": len(samples),
        "learned_mape": mape(learned, y),
        "analytic_mape": mape(analytic, y),
        "learned_spearman": spearman(learned, y),
        "analytic_spearman": spearman(analytic, y),
    }
