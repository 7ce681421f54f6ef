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
# # Large-batch training: a batch-size sweep and the noise scale's prediction
#
# How far can the batch grow before more examples are needed for the same quality, and which
# learning-rate recipe keeps it? This notebook runs a tiny batch-size sweep, reads the steps
# and examples each run needed to reach a target loss, fits the critical batch of McCandlish et
# al. (2018), and compares it with the gradient noise scale the runs measured while training.
# The same steps as these commands:
#
# ```bash
# python -m sweeps.launch sweeps.specs.batch_tiny --sweep-dir runs/sweeps/batch_tiny
# python -m sweeps.batch_analysis runs/sweeps/batch_tiny --target 0.545 --plots
# ```
#
# `sweeps.specs.batch_tiny` trains the tiny DLRM on the built-in tiny synthetic data at batches
# 16, 64 and 256 over the same 10,240 examples, with the square-root rule and CowClip's recipe
# (six runs, about half a minute on two CPU cores).

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

# %%
import json
import math
import subprocess

from IPython.display import Image, display

from recscale import notebook
from sweeps import batch_analysis
from sweeps.spec import load_spec, resolve

# Runs go to runs/notebooks/ at the repository root (see notebooks/README.md and
# recscale.notebook); RECSCALE_NOTEBOOK_RUNS overrides the location.
ROOT, RUNS = notebook.repo_root(), notebook.runs_dir()
SWEEP_DIR = RUNS / "batch_tiny"
print("sweep directory:", SWEEP_DIR)

# %% [markdown]
# ## The recipes
#
# A batch-size sweep keeps the examples fixed, so a run at batch B takes examples / B steps.
# Its learning rates come from the base preset's (tuned at its own batch, here 64) by a recipe:
# `sqrt` scales both optimizers' rates by the square root of the batch ratio s; `cowclip`
# (Zheng et al., AAAI 2023) scales the dense rate by sqrt(s), keeps the tables' rate, and clips
# every embedding row's gradient to cnt · max(r·‖w‖, ζ), cnt its occurrences in the batch. Every
# run also measures the gradient noise scale five times (`train.noise_scale_every`).

# %%
spec = load_spec("sweeps.specs.batch_tiny")
trials = resolve(spec).trials
for t in trials:
    emb = t.config["embedding_optim"]
    print(
        f"{t.trial_id}  batch {t.batch_size:4d}  {t.steps:4d} steps  {t.lr_rule:8s}"
        f"dense lr {t.config['dense_optim']['learning_rate']:.4f}  tables lr "
        f"{emb['learning_rate']:.4f}  cowclip r {emb['cowclip_ratio']}"
    )

# %% [markdown]
# ## Launch
#
# One subprocess per trial, through DLRM's normal train command; rerunning the cell only
# re-reads the finished results.

# %%
out = subprocess.run(
    [
        sys.executable,
        "-m",
        "sweeps.launch",
        "sweeps.specs.batch_tiny",
        "--sweep-dir",
        str(SWEEP_DIR),
        "--max-parallel",
        "2",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
)
print(out.stderr[-1000:])
summary = json.loads(out.stdout.strip().splitlines()[-1])
assert summary["statuses"] == {"SUCCESS": len(trials)}, summary

# %% [markdown]
# ## Steps and examples to a target
#
# The target: a little above the worst final loss among the runs, so that every run reaches
# it and the comparison is of speed, not of final quality. For each recipe and batch,
# `batch_analysis` takes the first evaluation at or below it; then it fits
# S(B) = S_min (1 + B_crit / B), the trade-off McCandlish et al. derive, whose knee B_crit is
# where doubling the batch stops halving the steps (infinite: steps still fall as 1/B at the
# largest batch measured).

# %%
finals = []
for t in trials:
    rows = (SWEEP_DIR / "trials" / t.trial_id / "run" / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, rows) if r["split"] == "eval"]
    finals.append(evals[-1]["logloss"])
target = round(max(finals) + 0.005, 3)
print("target logloss:", target)
result = batch_analysis.analyze(SWEEP_DIR, target=target)
for r in result["recipes"]:
    pts = {p["batch"]: p["steps"] for p in r["points"]}
    print(f"{r['recipe']:8s} steps to target by batch: {pts}  B_crit {r['b_crit']:.3g}")
    assert all(p["steps"] is not None for p in r["points"])

# %% [markdown]
# ## The noise scale's prediction
#
# B_simple = tr(Σ) / |G|², estimated during each run from its micro-batches' gradients
# against the whole batch's (`recscale.analysis.noise_scale`), dense parameters and tables
# apart. McCandlish et al. find B_crit ≈ B_simple for SGD on many tasks, with B_simple measured
# where training reaches the target. `batch_analysis` pools the measurements taken within a
# factor 2 of the step each run reached the target (each measurement's own unbiased |G|² and
# tr(Σ), averaged before the ratio), for the dense part, the tables and all parameters, with a
# bootstrap interval: a part whose |G|² the batches cannot resolve (sparse tables' gradients
# are mostly noise) shows as NaN or an unbounded interval. Each batch's late-run average is
# printed too.
#
# At this size the runs are too short to say much; `sweeps.specs.critical_batch` is the real
# measurement (three DLRM sizes, batches 256 to 16,384; results in BENCHMARKS.md).

# %%
for n in result["noise_at_target"]:
    print(
        f"{n['rung']}: B_simple at the target, all parameters {n['b_simple_total']:.3g} "
        f"[{n['b_simple_total_lo']:.3g}, {n['b_simple_total_hi']:.3g}], dense "
        f"{n['b_simple_dense']:.3g}, tables {n['b_simple_embedding']:.3g}, from "
        f"{n['measurements']} measurements of {n['runs']} runs"
    )
    assert n["measurements"] > 0
for n in result["noise_scale"]:
    print(
        f"batch {n['batch']:4d}: late-run B_simple dense {n['b_simple_dense']:.3g}, tables "
        f"{n['b_simple_embedding']:.3g}"
    )
    assert math.isfinite(n["b_simple_dense"]) and n["b_simple_dense"] > 0

# %% [markdown]
# ## Plot
#
# Steps (left) and examples (right) to the target against the batch, one line per recipe.
# Perfect scaling is a slope of -1 on the left and a flat line on the right.

# %%
display(Image(filename=str(batch_analysis.plot(result, SWEEP_DIR / "batch_curves.png"))))
