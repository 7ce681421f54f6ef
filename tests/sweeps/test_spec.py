"""Sweep specs: resolution into trials, the batch-size rule, and trial identity."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from sweeps import identity
from sweeps import spec as spec_lib
from sweeps.spec import BatchRule, FamilySpec, SweepSpec, dlrm_ladder, resolve, wukong_ladder

DLRM = FamilySpec(
    family="dlrm",
    preset="dlrm/tiny",
    ladder=dlrm_ladder(((4, (8, 4), (8, 1)), (8, (16, 8), (16, 1)), (8, (32, 8), (32, 1)))),
)


def make_spec(**kw) -> SweepSpec:
    return SweepSpec(
        **{
            "name": "t",
            "families": (DLRM,),
            "budgets": (2e7, 6e7, 2e8),
            "min_steps": 5,
            "code_version": "test",
            **kw,
        }
    )


def test_budget_resolves_to_examples_and_steps():
    res = resolve(make_spec())
    assert len(res.trials) == 9  # full IsoFLOP grid: 3 budgets x 3 rungs
    for t in res.trials:
        assert t.steps == round(t.budget / t.flops_per_example / t.batch_size)
        assert t.examples == t.steps * t.batch_size
        assert t.compute == pytest.approx(t.budget, rel=0.5 / t.steps + 1e-9)
        assert t.config["train"]["num_steps"] == t.steps
        # flops/example is the analytic training cost of the rung's model
        from data.config import DataConfig
        from data.schemas import schema_of
        from dlrm.config import DLRMModelConfig
        from recscale import config as config_lib

        model = config_lib.from_dict(DLRMModelConfig, t.config["model"])
        schema = schema_of(config_lib.from_dict(DataConfig, t.config["data"]))
        assert t.flops_per_example == model.cost(schema).train_flops


def test_diagonal_grid_climbs_the_ladder():
    res = resolve(make_spec(sizes_per_budget=2))
    by_budget = {}
    for t in res.trials:
        by_budget.setdefault(t.budget, []).append(t.rung_index)
    assert by_budget == {2e7: [0, 1], 6e7: [1, 2], 2e8: [1, 2]} or by_budget == {
        2e7: [0, 1],
        6e7: [0, 1],
        2e8: [1, 2],
    }  # round() of 0.5


def test_extend_below_adds_sizes_under_the_diagonal_window():
    res = resolve(make_spec(sizes_per_budget=1, extend_below=1))
    by_budget = {}
    for t in res.trials:
        by_budget.setdefault(t.budget, []).append(t.rung_index)
    assert by_budget == {2e7: [0], 6e7: [0, 1], 2e8: [1, 2]}  # no rung below 0


def test_windows_follow_the_predicted_optimum():
    """With an ``optimum`` law each budget runs the k rungs centred (in log FLOPs per example)
    on the law's prediction there: a flat law keeps one window, a rising law climbs, and the
    window is clamped to the ladder."""
    fpe = [t.flops_per_example for t in resolve(make_spec(budgets=(2e8,))).trials]

    def windows(optimum, **kw):
        fam = dataclasses.replace(DLRM, optimum=optimum)
        out = {}
        for t in resolve(make_spec(families=(fam,), sizes_per_budget=2, **kw)).trials:
            out.setdefault(t.budget, []).append(t.rung_index)
        return out

    # Flat at the smallest rung: the lowest window at every budget (the diagonal would climb).
    assert windows((fpe[0], 1e8, 0.0)) == {2e7: [0, 1], 6e7: [0, 1], 2e8: [0, 1]}
    # Flat at the largest: the top window everywhere.
    assert windows((fpe[2], 1e8, 0.0)) == {2e7: [1, 2], 6e7: [1, 2], 2e8: [1, 2]}
    # Rising through the ladder: from the bottom window to the top one.
    by_budget = windows((fpe[0], 2e7, math.log(fpe[2] / fpe[0]) / math.log(10)))
    assert by_budget == {2e7: [0, 1], 6e7: [0, 1], 2e8: [1, 2]}
    # extend_below still adds a rung under each window.
    assert windows((fpe[2], 1e8, 0.0), extend_below=1)[2e7] == [0, 1, 2]
    with pytest.raises(ValueError, match="optimum"):
        dataclasses.replace(DLRM, optimum=(0.0, 1e8, 0.5))


def test_steps_per_trial_fixes_every_run_length():
    res = resolve(make_spec(budgets=(1.0,), steps_per_trial=30, min_steps=1))
    assert {t.steps for t in res.trials} == {30} and len(res.trials) == 3
    assert len({t.compute for t in res.trials}) == 3  # compute follows each size


def test_too_few_steps_are_skipped_with_a_reason():
    res = resolve(make_spec(min_steps=200))
    assert res.skipped and all("min_steps=200" in s for s in res.skipped)
    assert all(t.steps >= 200 for t in res.trials)


def test_learning_rate_follows_the_batch_rule():
    base = resolve(make_spec()).trials[0]  # dlrm/tiny's own batch (64)
    big = resolve(make_spec(batch_size=256)).trials[0]
    # Adam and row-wise Adagrad: square-root rule.
    assert big.config["dense_optim"]["learning_rate"] == pytest.approx(
        base.config["dense_optim"]["learning_rate"] * 2
    )
    assert big.config["embedding_optim"]["learning_rate"] == pytest.approx(
        base.config["embedding_optim"]["learning_rate"] * 2
    )
    lin = resolve(make_spec(batch_size=256, batch_rule=BatchRule(dense_power=1.0))).trials[0]
    assert lin.config["dense_optim"]["learning_rate"] == pytest.approx(
        base.config["dense_optim"]["learning_rate"] * 4
    )
    assert BatchRule.default_power("sgd") == 1.0 and BatchRule.default_power("adam") == 0.5
    t = big
    assert t.config["dense_optim"]["warmup_steps"] == round(0.05 * t.steps)


def test_identity_ignores_non_semantic_fields_only():
    (t,) = resolve(make_spec(budgets=(2e7,), sizes_per_budget=1)).trials
    cfg = t.config
    same = {
        **cfg,
        "train": {
            **cfg["train"],
            "log_every": 7,
            "eval_every": 3,
            "progress": True,
            "checkpoint_every": 11,
        },
    }
    assert identity.trial_id("dlrm", same, "test", "fp") == identity.trial_id(
        "dlrm", cfg, "test", "fp"
    )
    changed = {**cfg, "dense_optim": {**cfg["dense_optim"], "learning_rate": 0.1234}}
    assert identity.trial_id("dlrm", changed, "test", "fp") != identity.trial_id(
        "dlrm", cfg, "test", "fp"
    )
    assert identity.trial_id("dlrm", cfg, "other-code", "fp") != identity.trial_id(
        "dlrm", cfg, "test", "fp"
    )
    assert identity.trial_id("dlrm", cfg, "test", "fp2") != identity.trial_id(
        "dlrm", cfg, "test", "fp"
    )
    # the spec's own knobs that are cadence only do not change ids either
    a = resolve(make_spec(evals_per_trial=2, checkpoints_per_trial=2)).trials
    b = resolve(make_spec(evals_per_trial=5, checkpoints_per_trial=3)).trials
    assert [x.trial_id for x in a] == [x.trial_id for x in b]
    c = resolve(make_spec(seeds=(1,))).trials
    assert not {x.trial_id for x in a} & {x.trial_id for x in c}


def test_data_fingerprint_tracks_file_content(tmp_path):
    from data.config import DataConfig

    f = tmp_path / "train.csv"
    f.write_text("a,b\n1,2\n")
    cfg = DataConfig(kind="frappe", train_path=str(f), eval_path=str(f))
    fp = identity.data_fingerprint(cfg)
    f.write_text("a,b\n1,3\n")
    assert identity.data_fingerprint(cfg) != fp


def test_tabular_identity_is_the_spec_and_files_not_their_paths(tmp_path):
    from data.config import DataConfig, TabularConfig

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x.csv").write_text("label,u\n1,a\n0,b\n")
        (tmp_path / d / "s.yaml").write_text(
            "train: [x.csv]\nlabel: {column: label}\nfeatures: [{name: u, kind: categorical}]\n"
        )
    cfgs = [
        DataConfig(
            kind="tabular",
            tabular=TabularConfig(spec=str(tmp_path / d / "s.yaml"), prepared_dir=f"/p/{d}"),
        )
        for d in ("a", "b")
    ]
    fps = [identity.data_fingerprint(c) for c in cfgs]
    assert fps[0] == fps[1]  # same content, other folder
    from recscale import config as config_lib

    ids = [identity.semantic_config({"data": config_lib.to_dict(c)}) for c in cfgs]
    assert ids[0] == ids[1]
    (tmp_path / "b" / "x.csv").write_text("label,u\n1,a\n0,c\n")
    assert identity.data_fingerprint(cfgs[1]) != fps[0]
    (tmp_path / "a" / "s.yaml").write_text(
        "train: [x.csv]\nlabel: {column: label}\nfeatures: [{name: u, kind: categorical, "
        "min_count: 2}]\n"
    )
    assert identity.data_fingerprint(cfgs[0]) != fps[0]


def test_overrides_and_wukong_ladder():
    fam = FamilySpec(
        family="wukong",
        preset="wukong/tiny",
        ladder=wukong_ladder(((1, 2, 2, 2, 1, 8), (2, 4, 4, 4, 1, 16))),
        overrides={"model.top_mlp": (8, 1), "dense_optim.decay": "cosine"},
    )
    res = resolve(make_spec(families=(fam,), budgets=(1e8,)))
    assert [t.rung for t in res.trials] == ["w1", "w2"]
    assert all(t.config["model"]["top_mlp"] == [8, 1] for t in res.trials)
    assert res.trials[1].config["model"]["num_layers"] == 2
    bad = dataclasses.replace(fam, overrides={"model.no_such_field": 1})
    with pytest.raises(ValueError, match="no_such_field"):
        resolve(make_spec(families=(bad,)))


def test_the_model_family_comes_from_the_preset_through_the_registry():
    """A family's trials run its registered train entry point (``recscale.families``), whatever
    the sweep calls the family; a preset of no known family is refused by name."""
    variant = dataclasses.replace(DLRM, family="dlrm@lr2")
    (t, *_) = resolve(make_spec(families=(variant,), budgets=(2e8,))).trials
    assert t.family == "dlrm@lr2" and t.package == "dlrm"
    assert t.train_command("c.json", "wd")[:2] == ["-m", "dlrm.train"]
    bad = dataclasses.replace(DLRM, family="x", preset="nosuch/tiny")
    with pytest.raises(ValueError, match="family x: preset 'nosuch/tiny': unknown model family"):
        resolve(make_spec(families=(bad,)))


def test_bad_specs_are_rejected():
    with pytest.raises(ValueError, match="increasing"):
        make_spec(budgets=(2e8, 2e7))
    with pytest.raises(ValueError, match="positive"):
        make_spec(budgets=(math.inf,))
    with pytest.raises(ValueError, match="sizes_per_budget"):
        make_spec(sizes_per_budget=4)


def test_specs_resolve_without_jax():
    code = (
        "import sys; from sweeps.spec import load_spec, resolve; import sweeps.launch;"
        "[resolve(load_spec(m)) for m in ('sweeps.specs.showcase', 'sweeps.specs.tiny')];"
        "bad = [m for m in ('jax', 'flax', 'grain', 'optax') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rung_overrides_set_the_schema_and_a_field_added_at_default_keeps_identity():
    from data.config import DataConfig, SyntheticConfig  # noqa: PLC0415

    data = DataConfig(
        kind="synthetic",
        batch_size=64,
        synthetic=SyntheticConfig(vocab_sizes=(5000, 100), max_hotness=(1, 1)),
    )
    ladder = (
        spec_lib.Rung("full", dict(embed_dim=8)),
        spec_lib.Rung(
            "capped", dict(embed_dim=8), {"data.max_table_rows": 500, "data.id_policy": "hash"}
        ),
    )
    fam = FamilySpec(family="dlrm", preset="dlrm/tiny", ladder=ladder)
    sweep = SweepSpec(name="t", families=(fam,), budgets=(1e9,), data=data, min_steps=1)
    full, cap = resolve(sweep).trials
    assert cap.config["data"]["max_table_rows"] == 500
    assert (full.params_sparse, cap.params_sparse) == (8 * 5100, 8 * 600)
    # Trials recorded before data.max_table_rows existed keep their ids: at its default (0)
    # the field is no part of identity.
    old = {k: v for k, v in full.config["data"].items() if k != "max_table_rows"}
    fp = identity.data_fingerprint(data)
    assert identity.trial_id("dlrm", {**full.config, "data": old}, "v", fp) == identity.trial_id(
        "dlrm", full.config, "v", fp
    )
    assert identity.trial_id("dlrm", cap.config, "v", fp) != identity.trial_id(
        "dlrm", full.config, "v", fp
    )
