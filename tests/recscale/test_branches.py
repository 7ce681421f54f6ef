"""Cooldown branches of a warmup-stable-decay run (``recscale.train.branches``): a branch equals
the one-piece run of its budget bitwise, resumes bitwise, and refuses a stable run it cannot
continue."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

import dlrm.presets  # noqa: F401
from dlrm.model import build_model
from recscale import config as config_lib
from recscale.config import get_preset
from recscale.train import branches
from recscale.train.loop import train
from tests.run_files import checkpoint_item, metric_rows

SMALL, LARGE = 15, 20  # budgets (steps); 20% cooldown: the small one branches at step 12


def _cfg(**train):
    """DLRM tiny where every part of the state matters: dropout (the random stream), Adam with
    warmup (moments, its count), row-wise Adagrad (accumulators), both on wsd schedules."""
    cfg = get_preset("dlrm/tiny")
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, dropout=0.3),
        dense_optim=dataclasses.replace(cfg.dense_optim, warmup_steps=2, decay="wsd"),
        embedding_optim=dataclasses.replace(cfg.embedding_optim, decay="wsd"),
        train=dataclasses.replace(
            cfg.train, progress=False, log_every=1, max_checkpoints=2, **train
        ),
    )


def _losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metric_rows(workdir)}


def _assert_same_params(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The stable run (budget LARGE, keeping SMALL's branch point), SMALL's branch off it, and
    SMALL's one-piece run."""
    root = tmp_path_factory.mktemp("wsd")
    # Checkpoints every 2 steps, of which max_checkpoints=2 are kept, and the branch point.
    stable_cfg = branches.stable_config(_cfg(checkpoint_every=2), [SMALL, LARGE])
    assert stable_cfg.train.num_steps == LARGE and stable_cfg.train.branch_steps == (12,)
    train(stable_cfg, build_model, root / "stable")
    branch_cfg = branches.branch_config(_cfg(), SMALL, root / "stable")
    assert branch_cfg.train.init_step == 12 and branch_cfg.train.num_steps == SMALL
    branch = train(branch_cfg, build_model, root / "branch")
    whole = train(_cfg(num_steps=SMALL), build_model, root / "whole")
    return root, branch_cfg, branch, whole


def test_a_branch_equals_the_one_piece_run_of_its_budget_bitwise(runs):
    root, _, branch, whole = runs
    # The stable run kept the branch point beside its latest max_checkpoints=2.
    kept = sorted(int(p.name) for p in (root / "stable" / "checkpoints").glob("[0-9]*"))
    assert kept == [12, 18, 20]
    stable, mine, one = (_losses(root / d) for d in ("stable", "branch", "whole"))
    assert sorted(mine) == [13, 14, 15]  # the branch trains its cooldown only
    assert [stable[s] for s in range(1, 13)] == [one[s] for s in range(1, 13)]
    assert [mine[s] for s in (13, 14, 15)] == [one[s] for s in (13, 14, 15)]
    _assert_same_params(
        checkpoint_item(root / "branch", SMALL), checkpoint_item(root / "whole", SMALL)
    )
    assert branch["logloss"] == whole["logloss"] and branch["auc"] == whole["auc"]
    # The cooldown is what differs from the stable run going on at its peak rate. A step's loss
    # is taken before its update, and the cooldown's first update is at the peak (``schedule(D)
    # == peak``): steps 13 and 14 see the same states in both, step 15 the first decayed one.
    assert mine[13] == stable[13] and mine[14] == stable[14] and mine[15] != stable[15]
    record = json.loads((root / "branch" / branches.BRANCH_FILE).read_text())
    assert record["init_from"] == str((root / "stable").absolute())
    assert (record["shared_steps"], record["own_steps"], record["cooldown_steps"]) == (12, 3, 3)


def test_a_stopped_branch_resumes_bitwise(runs, tmp_path, capsys):
    root, branch_cfg, branch, _ = runs
    cfg = dataclasses.replace(
        branch_cfg,
        train=dataclasses.replace(branch_cfg.train, checkpoint_every=1, max_checkpoints=5),
    )
    wd = tmp_path / "branch"
    train(cfg, build_model, wd)
    # The state a branch killed after step 13 leaves: its checkpoint 13, its metrics to 13.
    shutil.rmtree(wd / "checkpoints" / str(SMALL))
    rows = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(wd / "checkpoints" / "14")
    kept = [r for r in rows if r["step"] <= 13 and r["split"] == "train"]
    (wd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    capsys.readouterr()
    resumed = train(cfg, build_model, wd)
    assert "restored checkpoint step 13" in capsys.readouterr().err
    assert _losses(wd) == _losses(root / "branch")
    _assert_same_params(checkpoint_item(wd, SMALL), checkpoint_item(root / "branch", SMALL))
    assert resumed["logloss"] == branch["logloss"]


def _branch(runs, **changes):
    root, branch_cfg, _, _ = runs
    return dataclasses.replace(branch_cfg, **changes)


def test_a_branch_refuses_a_stable_run_it_cannot_continue(runs, tmp_path):
    root, branch_cfg, _, _ = runs
    other_lr = _branch(
        runs, dense_optim=dataclasses.replace(branch_cfg.dense_optim, learning_rate=1e-2)
    )
    with pytest.raises(config_lib.ConfigError, match=r"dense_optim.learning_rate: saved 0.003"):
        train(other_lr, build_model, tmp_path / "a")
    cosine = _branch(
        runs,
        dense_optim=dataclasses.replace(branch_cfg.dense_optim, decay="cosine"),
    )
    with pytest.raises(config_lib.ConfigError, match="branch must have its stable run's config"):
        train(cosine, build_model, tmp_path / "b")
    # Past this budget's decay start: the one-piece run decays there, the stable run does not.
    late = _branch(runs, train=dataclasses.replace(branch_cfg.train, init_step=13))
    with pytest.raises(config_lib.ConfigError, match=r"init_step=13: dense_optim.decay=wsd"):
        train(late, build_model, tmp_path / "c")
    # A step the stable run did not keep.
    early = _branch(runs, train=dataclasses.replace(branch_cfg.train, init_step=5))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 5 .*available steps"):
        train(early, build_model, tmp_path / "d")
    nowhere = _branch(runs, train=dataclasses.replace(branch_cfg.train, init_from=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="train.init_from: no run"):
        train(nowhere, build_model, tmp_path / "e")
    assert not list(tmp_path.glob("*/checkpoints/[0-9]*"))  # none of them trained


def test_cosine_branches_are_refused_where_the_rate_depends_on_the_length(tmp_path):
    """Both runs cosine: their rates differ from the end of the warmup on."""
    cfg = get_preset("dlrm/tiny")
    cos = dataclasses.replace(
        cfg, dense_optim=dataclasses.replace(cfg.dense_optim, warmup_steps=2, decay="cosine")
    )
    stable = dataclasses.replace(cos, train=dataclasses.replace(cos.train, num_steps=LARGE))
    branch = dataclasses.replace(
        cos, train=dataclasses.replace(cos.train, num_steps=SMALL, init_from="x", init_step=12)
    )
    with pytest.raises(config_lib.ConfigError, match="from step 2"):
        branches.check_branch(branch, stable)
    early = dataclasses.replace(branch, train=dataclasses.replace(branch.train, init_step=2))
    branches.check_branch(early, stable)  # within the shared warmup: the same rates


def test_train_config_checks_the_branch_fields():
    t = get_preset("dlrm/tiny").train
    with pytest.raises(ValueError, match="init_step=3: must be >= 0, and > 0 only with init_from"):
        dataclasses.replace(t, init_step=3)
    with pytest.raises(
        ValueError, match=r"branch_steps \[20\]: each must be in \(0, num_steps=20\)"
    ):
        dataclasses.replace(t, branch_steps=(5, 20))
    with pytest.raises(ValueError, match="cooldown_fraction must be in"):
        dataclasses.replace(get_preset("dlrm/tiny").dense_optim, cooldown_fraction=0.0)


def test_the_new_fields_at_their_defaults_keep_trial_identities():
    from sweeps.identity import semantic_config

    cfg = get_preset("dlrm/tiny")
    before = config_lib.to_dict(cfg)  # a config as recorded before the fields existed
    for section in ("dense_optim", "embedding_optim"):
        for key in ("cooldown_fraction", "cooldown_shape"):
            del before[section][key]
    for key in ("init_step", "branch_steps"):
        del before["train"][key]
    now = semantic_config(config_lib.to_dict(cfg), type(cfg))
    assert now == semantic_config(before, type(cfg))
    # A stable run's branch points are cadence, no part of the identity; a cooldown is.
    kept = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, branch_steps=(8,)))
    assert semantic_config(config_lib.to_dict(kept), type(cfg)) == now
    longer = dataclasses.replace(
        cfg, dense_optim=dataclasses.replace(cfg.dense_optim, cooldown_fraction=0.3)
    )
    assert semantic_config(config_lib.to_dict(longer), type(cfg)) != now
