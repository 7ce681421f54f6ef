# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Evaluating a checkpoint: metrics, per-example predictions, calibration
#
# Open a run directory (what `python -m dlrm.train ... --workdir DIR` writes), evaluate its
# latest checkpoint as `python -m dlrm.evaluate --workdir DIR` does, then recompute the metrics
# from per-example predictions and check how well calibrated the predicted probabilities are: a
# reliability diagram (mean predicted probability against observed positive rate, per bin), a
# histogram of the predictions, and the expected calibration error (ECE).

# %%
import sys

# Placeholder URL: replace it with the project's real repository once it is published.
REPO_URL = "https://github.com/recscale/recscale"

# In Colab, install recscale (and its dependencies) first; locally it is already installed in the
# project's virtual environment (`make install`), so nothing happens.
if "google.colab" in sys.modules:
    import subprocess

    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", f"git+{REPO_URL}"], check=True
    )

# %% [markdown]
# Point `WORKDIR` at your own run and set `FAMILY` to the package that trained it (`dlrm` or
# `wukong`). A relative `WORKDIR` is taken from the repository root. Left empty, the notebook
# uses `runs/notebooks/checkpoint_evaluation/<FAMILY>_tiny`; whenever the directory holds no run
# yet, a short `<FAMILY>/tiny` run is trained there first (a few seconds on CPU).

# %% tags=["parameters"]
WORKDIR = ""
FAMILY = "dlrm"

# %%
import dataclasses
import json
import math
from pathlib import Path

import jax
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

import dlrm.presets  # noqa: F401  (importing a family's presets module registers its presets)
import wukong.presets  # noqa: F401
from dlrm.config import DLRMConfig
from dlrm.model import build_model as build_dlrm
from recscale import config as config_lib
from recscale import notebook, sharding
from recscale.metrics import EvalAccumulator
from recscale.train.checkpoint import Checkpointer
from recscale.train.evaluation import EvalArgs, evaluate_workdir
from recscale.train.experiment import Experiment
from recscale.train.loop import train
from recscale.train.steps import make_eval_step
from wukong.config import WukongConfig
from wukong.model import build_model as build_wukong

# The config class and model builder of each family: what its evaluate.py passes to
# evaluate_workdir.
FAMILIES = {"dlrm": (DLRMConfig, build_dlrm), "wukong": (WukongConfig, build_wukong)}
config_cls, build_model = FAMILIES[FAMILY]

# Default runs go to runs/notebooks/ at the repository root (ignored by git; see
# recscale.notebook); RECSCALE_NOTEBOOK_RUNS overrides the location.
ROOT, RUNS = notebook.repo_root(), notebook.runs_dir()
if WORKDIR:
    workdir = ROOT / Path(WORKDIR).expanduser()  # an absolute WORKDIR replaces ROOT
else:
    workdir = RUNS / "checkpoint_evaluation" / f"{FAMILY}_tiny"

if not (workdir / "config.json").is_file():
    cfg = config_lib.get_preset(f"{FAMILY}/tiny")
    # 150 steps instead of the preset's 20: enough for the predictions to spread out.
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, num_steps=150, log_every=10, progress=False)
    )
    print(f"no run in {workdir}: training {FAMILY}/tiny for {cfg.train.num_steps} steps")
    # argv is what command.txt records: the equivalent command, not the kernel's argv.
    cli = [
        f"{FAMILY}/tiny",
        "--workdir",
        str(workdir),
        "--train.num-steps",
        "150",
        "--train.log-every",
        "10",
        "--train.no-progress",
    ]
    train(cfg, build_model, workdir, argv=["-m", f"{FAMILY}.train", *cli])
print("run:", workdir)
print((workdir / "command.txt").read_text())

# %% [markdown]
# ## Metrics of the latest checkpoint
#
# `evaluate_workdir` is the body of `python -m dlrm.evaluate --workdir DIR` (and of
# `wukong.evaluate`): it rebuilds the model from `config.json`, restores the checkpoint's
# parameters and BatchNorm statistics and evaluates over the whole evaluation set.

# %%
metrics = evaluate_workdir(config_cls, build_model, EvalArgs(workdir=str(workdir)))
print(json.dumps({k: metrics[k] for k in ("step", "auc", "logloss", "ne", "calibration")}))

# %% [markdown]
# ## Per-example predictions
#
# `evaluate_workdir` returns only the aggregated metrics, so the next cell repeats its steps with
# the same public pieces and keeps every example's logit: load the config, make a mesh of the
# devices that divide the evaluation batch, build the `Experiment` (model, data source and
# shardings; no optimizer), restore `params` and `batch_stats` onto its abstract state, and run
# the jitted evaluation step over the evaluation batches. Single-process only: with several hosts
# each would only see its own rows of a batch.

# %%
cfg = config_lib.load_json(config_cls, workdir / "config.json")
ckpt = Checkpointer(workdir / "checkpoints", async_save=False)
step = ckpt.latest_step()
mesh_cfg = dataclasses.replace(
    cfg.mesh,
    data_parallel=math.gcd(cfg.data.eval_batch_size, jax.device_count()),
    model_parallel=1,
)
with sharding.activate(sharding.make_mesh(mesh_cfg), mesh_cfg):
    exp = Experiment.build(
        cfg, build_model, with_optimizer=False, eval_only=True, workdir=str(workdir)
    )
    abstract = exp.abstract_state
    trees, meta = ckpt.restore(
        step, {"params": abstract.params, "batch_stats": abstract.batch_stats}
    )
    eval_step = jax.jit(make_eval_step(exp.graphdef))
    parts = []
    for batch in exp.source.eval_batches():
        logits_b = eval_step(trees["params"], trees["batch_stats"], exp.device_batch(batch))
        parts.append((np.asarray(logits_b), batch.labels_b, batch.weights_b))
ckpt.close()
logits, labels, weights = (np.concatenate(x) for x in zip(*parts, strict=True))
# Weight 0 marks the padding of the last batch: drop it.
keep = weights > 0
logits, labels, weights = logits[keep], labels[keep], weights[keep]
probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
predictions = pd.DataFrame({"logit": logits, "prob": probs, "label": labels, "weight": weights})
print(f"step {meta['step']}: {len(predictions)} examples")
print(predictions.describe().round(4).to_string())

# %% [markdown]
# The predictions give back the library's metrics (`EvalAccumulator` is what `Experiment.evaluate`
# accumulates), and those agree with the trainer's own final evaluation row in `metrics.jsonl`.

# %%
acc = EvalAccumulator()
acc.update(logits, labels, weights)
ours = acc.result()

rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
# The trainer's evaluation of this step over the whole set (rows of periodic evaluations may
# cover only `train.eval_max_batches` batches; an interrupted run may have none for its latest
# checkpoint).
final = [
    r
    for r in rows
    if r["split"] == "eval" and r["step"] == meta["step"] and r["num_examples"] == len(predictions)
]
trainer = final[-1] if final else {}
table = pd.DataFrame({"per-example": ours, "evaluate_workdir": metrics, "metrics.jsonl": trainer})
print(table.loc[["auc", "logloss", "ne", "calibration", "num_examples"]].to_string())
if not trainer:
    # Only an interrupted run of the user's lacks it; the notebook's own run always has one.
    assert WORKDIR, "metrics.jsonl lacks the trainer's final evaluation row"
    print(f"metrics.jsonl has no full evaluation of step {meta['step']}: compared with nothing")

# The checkpoint holds the trained state itself and the evaluation set is the same rows in the
# same order, so all three must agree. They are compared with a small tolerance rather than
# exactly because the trainer evaluated on the training mesh and this notebook on this machine's
# devices: another device count may sum in another order and move the logits in the last bits
# (which can flip a near-tie in AUC); a wrong checkpoint, model or evaluation set moves them by
# orders of magnitude more. (On CPU they agree bitwise in practice, also for a run trained on 8
# devices and evaluated on 1.)
assert ours["num_examples"] == metrics["num_examples"]
for key, tol in (("auc", 1e-4), ("logloss", 1e-5)):
    for name, row in (("evaluate_workdir", metrics), ("metrics.jsonl", trainer)):
        value = row.get(key, ours[key])
        assert abs(ours[key] - value) <= tol, f"{key}: per-example {ours[key]} vs {name} {value}"


# %% [markdown]
# ## Calibration
#
# Split the predicted probabilities into equal-width bins; in each, compare the (weighted) mean
# predicted probability with the observed positive rate. A calibrated model sits on the
# diagonal. The expected calibration error is the weighted mean absolute gap over bins,
# `ECE = sum_b (w_b / W) |mean_pred_b - pos_rate_b|`. With a single bin it is the gap between
# the mean prediction and the mean label, the quantity behind the library's `calibration`
# (their ratio). The binned ECE is never smaller than that gap, and equals it when every bin errs
# in the same direction.


# %%
def reliability(probs, labels, weights, num_bins=10):
    """Per-bin weight, mean prediction and positive rate over equal-width bins, and the ECE."""
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    bin_of = np.digitize(probs, edges[1:-1])  # 0 .. num_bins - 1
    w = np.bincount(bin_of, weights=weights, minlength=num_bins)
    pred = np.bincount(bin_of, weights=weights * probs, minlength=num_bins)
    pos = np.bincount(bin_of, weights=weights * labels, minlength=num_bins)
    full = w > 0
    bins = pd.DataFrame(
        {
            "lo": edges[:-1],
            "hi": edges[1:],
            "weight": w,
            "mean_pred": np.where(full, pred / np.where(full, w, 1), np.nan),
            "pos_rate": np.where(full, pos / np.where(full, w, 1), np.nan),
        }
    )
    ece = float(np.sum(w[full] / w.sum() * np.abs(bins["mean_pred"] - bins["pos_rate"])[full]))
    return bins, ece


bins, ece = reliability(probs, labels, weights)
_, ece_1 = reliability(probs, labels, weights, num_bins=1)
assert math.isclose(ece_1, abs(metrics["mean_prediction"] - metrics["mean_label"]), abs_tol=1e-9)
print(bins[bins["weight"] > 0].round(4).to_string(index=False))
print(f"ECE (10 bins) = {ece:.4f}")
print(f"|mean prediction - mean label| = {ece_1:.4f} (the ECE of a single bin)")
print(f"calibration = mean prediction / mean label = {metrics['calibration']:.4f}")

# %%
full = bins[bins["weight"] > 0]
fig, (ax1, ax2) = plt.subplots(
    2, 1, figsize=(5.5, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
)
ax1.plot([0, 1], [0, 1], ls="--", color="gray", label="calibrated")
ax1.plot(full["mean_pred"], full["pos_rate"], marker="o", label=f"model (ECE {ece:.3f})")
ax1.set(ylabel="observed positive rate", xlim=(0, 1), ylim=(0, 1))
ax1.set_title(f"reliability diagram: {workdir.name}, step {meta['step']}")
ax1.grid(alpha=0.3)
ax1.legend(loc="upper left")
ax2.hist(probs, bins=50, range=(0, 1), weights=weights, color="C0")
ax2.set(xlabel="predicted probability", ylabel="examples")
fig.tight_layout()
plt.show()

# %% [markdown]
# Equal-width bins put most examples of a model with a low base rate into a few bins; with many
# examples, equal-mass bins (quantiles of `probs`) resolve that range better. The ECE depends on
# the binning, so compare ECEs only at the same binning and evaluation set.
