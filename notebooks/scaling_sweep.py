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
# # recscale scaling sweep: launch a tiny sweep, fit the laws, plot them
#
# The same steps as these commands:
#
# ```bash
# python -m sweeps.launch sweeps.specs.tiny --sweep-dir runs/sweeps/tiny --max-parallel 2
# python -m sweeps.analyze runs/sweeps/tiny
# ```
#
# `sweeps.specs.tiny` runs DLRM and Wukong on the built-in tiny synthetic data: three compute
# budgets over one decade, two model sizes per budget, twelve short trials (about two minutes
# on two CPU cores). `make run` runs the bigger `sweeps.specs.showcase` the same way.

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
import subprocess

import numpy as np
from IPython.display import Image, display

from recscale import notebook
from sweeps import analyze, fit, reference
from sweeps.spec import load_spec, resolve

# Runs go to runs/notebooks/ at the repository root (see notebooks/README.md and
# recscale.notebook); RECSCALE_NOTEBOOK_RUNS overrides the location.
ROOT, RUNS = notebook.repo_root(), notebook.runs_dir()
SWEEP_DIR = RUNS / "scaling_sweep"
print("sweep directory:", SWEEP_DIR)

# %% [markdown]
# ## The spec resolves into trials
#
# A spec names model families, compute budgets (training FLOPs) and a ladder of model sizes per
# family. Each (budget, size) becomes one trial: examples = budget / training FLOPs per example,
# steps = examples / batch, learning rate from the batch-size rule. Resolving needs no jax.

# %%
spec = load_spec("sweeps.specs.tiny")
res = resolve(spec)
for t in res.trials:
    print(
        f"{t.trial_id}  {t.family:7s} {t.rung}  budget {t.budget:.0e}  "
        f"{t.flops_per_example:8.0f} FLOPs/ex  {t.steps:4d} steps"
    )

# %% [markdown]
# ## Launch
#
# The launcher runs each trial through the family's normal train command, one subprocess per
# trial. It is idempotent: run this cell again and it only re-reads the finished results (or
# finishes what an interrupted launch left).

# %%
out = subprocess.run(
    [
        sys.executable,
        "-m",
        "sweeps.launch",
        "sweeps.specs.tiny",
        "--sweep-dir",
        str(SWEEP_DIR),
        "--max-parallel",
        "2",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
)
print(out.stderr[-1500:])
summary = json.loads(out.stdout.strip().splitlines()[-1])
print(summary)
assert summary["statuses"] == {"SUCCESS": len(res.trials)}, summary

# %% [markdown]
# ## Results as a DataFrame
#
# One row per finished trial (`results.jsonl`, append-only); metrics are flattened into
# `final_*` / `best_*` columns.

# %%
df = analyze.load_results(SWEEP_DIR)
df[
    [
        "family",
        "rung",
        "budget",
        "compute",
        "flops_per_example",
        "steps",
        "final_logloss",
        "final_auc",
        "wall_time_s",
    ]
].sort_values(["family", "budget"])

# %% [markdown]
# ## Fit L(C) = a·C^(−b) + c per family
#
# `analyze` fits each family's compute-efficient frontier (the best trial per budget) with a
# Huber fit in log space, bootstrap intervals over the frontier trials, the slope per decade,
# and a holdout of the largest budget. With three budgets the law has no degrees of freedom
# left, so the intervals are wide and the holdout has too few points: a real sweep uses more
# budgets (`sweeps.specs.showcase` has five).

# %%
result = analyze.analyze(df, "logloss", n_boot=500)
for family, d in result["families"].items():
    law = d["law"]
    print(family, d.get("law_str") or d.get("reason"))
    if law:
        print(
            "   b 95% CI",
            np.round(law["intervals"]["b"], 3),
            " dL/decade",
            round(law["slope_per_decade"], 4),
        )
    print("   holdout:", d["holdout"].get("reason") or f"{d['holdout']['rel_error']:.2%}")

# %% [markdown]
# The fitting functions also work on any arrays, e.g. to check a law on synthetic points:

# %%
c = np.geomspace(1e12, 1e15, 12)
true = 0.3 * (c / 1e12) ** -0.25 + 0.4
noisy = true * np.exp(np.random.default_rng(0).normal(0, 0.01, c.size))
law = fit.fit_power_law(c, noisy, n_boot=500)
print(law.law_str(), "b in", np.round(law.intervals["b"], 3))
assert law.intervals["b"][0] < 0.25 < law.intervals["b"][1]

# %% [markdown]
# ## Plots
#
# `scaling.png`: quality vs compute per family (all trials faint, frontier bold, fitted law
# with its 95% band, dotted line at the planted teacher's Bayes-optimal logloss);
# `isoflop.png`: at each budget, quality vs model size (FLOPs per example).

# %%
ref = reference.bayes_reference(SWEEP_DIR, "logloss")
paths = analyze.plot(result, SWEEP_DIR, "logloss", reference=ref)
for p in paths:
    display(Image(filename=str(p)))
