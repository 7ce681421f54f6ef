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
# # recscale quickstart: train and evaluate a tiny DLRM, then a tiny Wukong
#
# This notebook does in Python what these two commands do from a shell:
#
# ```bash
# python -m dlrm.train dlrm/tiny --workdir runs/tiny       # train (resumes if the workdir has a run)
# python -m dlrm.evaluate --workdir runs/tiny              # evaluate the latest checkpoint
# ```
#
# Everything runs on CPU in well under a minute: the `*/tiny` presets train on a small built-in
# synthetic dataset (planted-teacher labels, multi-hot ids), so nothing is downloaded.

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
import dataclasses
import shutil

import matplotlib.pyplot as plt
import pandas as pd

import dlrm.presets  # noqa: F401  (importing a family's presets module registers its presets)
import wukong.presets  # noqa: F401
from data.synthetic import synthetic_schema
from dlrm.config import DLRMConfig
from dlrm.model import build_model as build_dlrm
from recscale import notebook
from recscale.config import get_preset, parse_preset_cli, preset_names
from recscale.flops import model_cost
from recscale.train.evaluation import EvalArgs, evaluate_workdir
from recscale.train.loop import train
from wukong.config import WukongConfig
from wukong.model import build_model as build_wukong

# Runs go to runs/notebooks/ at the repository root (ignored by git; see recscale.notebook);
# RECSCALE_NOTEBOOK_RUNS overrides the location (the tests point it at a temporary directory).
RUNS = notebook.runs_dir() / "quickstart"
print("runs under", RUNS)
print("presets:", ", ".join(preset_names("dlrm/") + preset_names("wukong/")))

# %% [markdown]
# ## A preset is a frozen dataclass
#
# Presets are plain Python functions registered by name; `get_preset` calls one and returns the
# run's whole config (model, data, optimizers, training loop, mesh). Its docstring (in
# `dlrm/presets.py`) states the command and the result to expect.

# %%
cfg = get_preset("dlrm/tiny")
print(cfg.model)
print(cfg.data.batch_size, cfg.data.synthetic)
print(cfg.train)

# %% [markdown]
# Configs are frozen: override fields with `dataclasses.replace` (a misspelt field is a
# `TypeError`, never silently ignored). Here: 150 steps instead of 20 (enough for the tiny model
# to learn something), a loss row every 10 steps, and no progress bar.
#
# On the command line the same overrides are typed flags; `parse_preset_cli` is what
# `python -m dlrm.train` parses them with, so the cell checks that the command below builds the
# very same config.

# %%
cfg = dataclasses.replace(
    cfg, train=dataclasses.replace(cfg.train, num_steps=150, log_every=10, progress=False)
)
workdir = RUNS / "dlrm_tiny"
overrides = ["--train.num-steps", "150", "--train.log-every", "10", "--train.no-progress"]
cli = ["dlrm/tiny", "--workdir", str(workdir), *overrides]
print("python -m dlrm.train", " ".join(cli))
_, cli_cfg = parse_preset_cli("dlrm/", cli)
assert cli_cfg == cfg

# %% [markdown]
# ## Train
#
# `train(cfg, build_model, workdir)` is the loop `python -m dlrm.train` calls: it writes
# `config.json` and `command.txt`, resumes from the workdir's latest checkpoint if there is one,
# appends train and eval rows to `metrics.jsonl`, saves a checkpoint at the end and returns the
# final evaluation. The workdir is wiped first so that re-running the notebook starts a fresh
# run (training again in place would resume the finished run and do nothing).

# %%
shutil.rmtree(workdir, ignore_errors=True)
# argv is what command.txt records; pass the equivalent command rather than the kernel's argv.
dlrm_result = train(cfg, build_dlrm, workdir, argv=["-m", "dlrm.train", *cli])
print({k: dlrm_result[k] for k in ("step", "auc", "logloss", "ne", "calibration")})
print(sorted(p.name for p in workdir.iterdir()))

# %% [markdown]
# ## Training curve
#
# `metrics.jsonl` has one JSON object per line: `split == "train"` rows (mean loss over the last
# `log_every` steps, gradient and update norms, the dense parameters' norm, examples/s) and `split == "eval"` rows.

# %%
dlrm_metrics = pd.read_json(workdir / "metrics.jsonl", lines=True)
dlrm_train = dlrm_metrics[dlrm_metrics["split"] == "train"]
print(dlrm_train[["step", "loss", "grad_norm", "update_norm", "dense_param_norm"]].tail())

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(dlrm_train["step"], dlrm_train["loss"], marker="o", label="dlrm/tiny")
ax.set(xlabel="step", ylabel="training logloss (nats)", title="dlrm/tiny")
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# ## Evaluate the saved checkpoint
#
# `evaluate_workdir` is the body of `python -m dlrm.evaluate --workdir DIR [--step N]
# [--data-path FILE]`: it rebuilds the model from `config.json`, restores the latest checkpoint
# and evaluates exactly over the whole evaluation set (AUC is exact, not bucketed). From a shell:
#
# ```bash
# python -m dlrm.evaluate --workdir runs/notebooks/quickstart/dlrm_tiny
# ```
#
# prints the same numbers as one JSON object on its last line.

# %%
dlrm_eval = evaluate_workdir(DLRMConfig, build_dlrm, EvalArgs(workdir=str(workdir)))
print(
    f"dlrm/tiny step {dlrm_eval['step']}: AUC {dlrm_eval['auc']:.4f}, "
    f"logloss {dlrm_eval['logloss']:.4f} over {dlrm_eval['num_examples']} examples"
)
# The checkpoint is the trained state and the evaluation set is fixed, so this repeats the
# trainer's final evaluation.
assert abs(dlrm_eval["auc"] - dlrm_result["auc"]) < 1e-6, (dlrm_eval, dlrm_result)

# %% [markdown]
# ## Same data, another model: Wukong
#
# `wukong/tiny` trains on the same synthetic data; only the model differs. The commands are
# `python -m wukong.train wukong/tiny --workdir ...` and `python -m wukong.evaluate --workdir ...`.

# %%
wcfg = get_preset("wukong/tiny")
wcfg = dataclasses.replace(
    wcfg, train=dataclasses.replace(wcfg.train, num_steps=150, log_every=10, progress=False)
)
assert wcfg.data == cfg.data
wworkdir = RUNS / "wukong_tiny"
shutil.rmtree(wworkdir, ignore_errors=True)
wcli = ["wukong/tiny", "--workdir", str(wworkdir), *overrides]
train(wcfg, build_wukong, wworkdir, argv=["-m", "wukong.train", *wcli])
wukong_eval = evaluate_workdir(WukongConfig, build_wukong, EvalArgs(workdir=str(wworkdir)))

# %% [markdown]
# Parameter and FLOP counts come from `recscale.flops.model_cost` (analytic, per example). At
# this size and step count the comparison says little about the architectures; it only shows
# how to set one up.

# %%
schema = synthetic_schema(cfg.data.synthetic)
rows = []
for name, c, ev in (("dlrm/tiny", cfg, dlrm_eval), ("wukong/tiny", wcfg, wukong_eval)):
    cost = model_cost(c, schema)
    rows.append(
        {
            "model": name,
            "dense params": cost.dense_params,
            "sparse params": cost.sparse_params,
            "fwd FLOP/example": cost.forward_flops,
            "AUC": ev["auc"],
            "logloss": ev["logloss"],
            "NE": ev["ne"],
        }
    )
print(pd.DataFrame(rows).set_index("model").round(4).to_string())

wukong_metrics = pd.read_json(wworkdir / "metrics.jsonl", lines=True)
wukong_train = wukong_metrics[wukong_metrics["split"] == "train"]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(dlrm_train["step"], dlrm_train["loss"], marker="o", label="dlrm/tiny")
ax.plot(wukong_train["step"], wukong_train["loss"], marker="s", label="wukong/tiny")
ax.set(xlabel="step", ylabel="training logloss (nats)", title="same data, two models")
ax.grid(alpha=0.3)
ax.legend()
plt.show()

# %% [markdown]
# Next: `checkpoint_evaluation.ipynb` opens a run directory like these, recomputes its metrics
# from per-example predictions and draws a calibration (reliability) diagram.
