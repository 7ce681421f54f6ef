"""The sequential families on the project's trainer (``sequential.task``): the tiny presets
train on planted data and their loss falls; a resumed run equals the straight one bitwise; the
``evaluate`` command reproduces the final evaluation from the checkpoint; settings the families
do not support fail with a clear error; a few steps on SASRec's real Video.txt."""

from __future__ import annotations

import dataclasses
import importlib
import shutil

import jax
import numpy as np
import pytest

from recscale import families
from recscale.config import ConfigError, EmbeddingShardingConfig, get_preset
from recscale.train.loop import train
from recscale.train.population import check_members
from tests.data.sequences.video import video_path
from tests.run_files import checkpoint_item, metric_rows

STEPS, RESUME_AT = 12, 6
FAMILIES = {name: families.load(name) for name in ("hstu", "sasrec")}  # registers the presets


def _cfg(name: str, **train_kw):
    cfg = get_preset(f"{name}/tiny")
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, dropout=0.1),  # the random stream matters
        train=dataclasses.replace(
            cfg.train, num_steps=STEPS, log_every=1, progress=False, **train_kw
        ),
    )


@pytest.fixture(scope="module", params=["hstu", "sasrec"])
def straight(request, tmp_path_factory):
    """A tiny run of ``STEPS`` steps with dropout, a checkpoint and an evaluation every
    ``RESUME_AT``."""
    cfg = _cfg(request.param, checkpoint_every=RESUME_AT, max_checkpoints=5, eval_every=RESUME_AT)
    wd = tmp_path_factory.mktemp(f"straight-{request.param}")
    result = train(cfg, FAMILIES[request.param].build_model, wd)
    return FAMILIES[request.param], cfg, wd, result


def test_tiny_trains_loss_falls_and_reports_flops_per_token(straight):
    _, cfg, wd, result = straight
    rows = metric_rows(wd)
    first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
    assert last < 0.8 * first, (first, last)
    for key in ("loss", "hr@10", "ndcg@10", "mrr", "bayes_loss", "num_examples"):
        assert np.isfinite(result[key]), key
    assert result["num_examples"] == cfg.data.planted.num_eval_users
    assert 0 <= result["hr@10"] <= 1 and result["loss"] > result["bayes_loss"]
    assert len(metric_rows(wd, "eval")) == 2  # at RESUME_AT and at the end
    row = rows[-1]  # FLOPs: the config's cost per real token, at the batch's history lengths
    cost = cfg.model.cost(seq_len=row["tokens_x_len"] / row["tokens"], loss=cfg.loss)
    assert row["train_flops"] == pytest.approx(row["tokens"] * cost.train_flops)


def test_resume_equals_straight_run_bitwise(straight, tmp_path):
    fam, cfg, full, _ = straight
    shutil.copy(full / "config.json", tmp_path / "config.json")
    ckpt = f"checkpoints/{RESUME_AT}"
    shutil.copytree(full / ckpt, tmp_path / ckpt)
    train(cfg, fam.build_model, tmp_path)

    def losses(wd):
        return {r["step"]: r["loss"] for r in metric_rows(wd) if r["step"] > RESUME_AT}

    assert sorted(losses(tmp_path)) == list(range(RESUME_AT + 1, STEPS + 1))
    assert losses(tmp_path) == losses(full)
    for item in ("params", "opt_state", "rng"):
        a, b = checkpoint_item(full, STEPS, item), checkpoint_item(tmp_path, STEPS, item)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=item)
    # Not a cold start: steps 7..12 are not the run's first six.
    assert list(losses(full).values()) != [r["loss"] for r in metric_rows(full)[:6]]


def test_evaluate_command_reproduces_the_final_evaluation(straight, tmp_path):
    fam, _, wd, result = straight
    evaluate = importlib.import_module(fam.module("evaluate"))
    out = evaluate.main(["--workdir", str(wd), "--output", str(tmp_path / "ev.json")])
    assert out["step"] == STEPS
    for key in ("loss", "hr@10", "ndcg@10", "hr@50", "mrr", "num_examples", "bayes_loss"):
        assert out[key] == pytest.approx(result[key], rel=1e-6), key
    assert out["data_path"].startswith("planted:")
    with pytest.raises(SystemExit, match="--curvature: not supported"):
        evaluate.main(["--workdir", str(wd), "--curvature"])
    with pytest.raises(SystemExit, match="planted data holds out whole users"):
        evaluate.main(["--workdir", str(wd), "--eval-split", "test"])


def test_unsupported_settings_fail_clearly(tmp_path):
    from sequential.hstu import train as hstu_train  # noqa: PLC0415

    with pytest.raises(SystemExit, match="embeddings.measure_skew: it counts CTR batches' ids"):
        hstu_train.main(
            ["hstu/tiny", "--workdir", str(tmp_path / "a"), "--embeddings.measure-skew", "2"]
        )
    with pytest.raises(SystemExit, match="embedding_optim.cowclip_ratio"):
        hstu_train.main(
            ["hstu/tiny", "--workdir", str(tmp_path / "b"), "--embedding-optim.cowclip-ratio", "1"]
        )
    cfg = get_preset("sasrec/games")
    missing = dataclasses.replace(cfg.data, sasrec_path=str(tmp_path / "nope.txt"))
    with pytest.raises(FileNotFoundError, match=r"nope.txt: no such file.*--data.sasrec-path"):
        cfg.task().make_source(
            dataclasses.replace(cfg, data=missing),
            process_index=0,
            process_count=1,
            eval_path=None,
            rejects_dir=None,
            eval_only=True,
        )
    with pytest.raises(ValueError, match="data.planted.n_items=200 but model.n_items=7"):
        cfg = get_preset("hstu/tiny")
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_items=7))
    with pytest.raises(ConfigError, match="populations train the CTR families only"):
        check_members([get_preset("hstu/tiny")])


def test_sasrec_games_steps_on_the_real_video_txt(tmp_path):
    cfg = get_preset("sasrec/games")
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(
            cfg.data,
            sasrec_path=video_path(tmp_path),
            batch_size=8,
            eval_batch_size=8,
            eval_users=64,
            max_sequences=8,
            token_budget=8 * 50,
        ),
        model=dataclasses.replace(cfg.model, d_model=8, num_layers=1),
        mesh=dataclasses.replace(cfg.mesh, data_parallel=8),
        embeddings=EmbeddingShardingConfig(sharding="off"),
        train=dataclasses.replace(
            cfg.train, num_steps=2, eval_every=0, eval_max_batches=1, progress=False, log_every=1
        ),
    )
    # 64 of the 30,901 users with a validation item: one evaluation step of 8 packs.
    result = train(cfg, FAMILIES["sasrec"].build_model, tmp_path / "run")
    assert result["num_examples"] == 64
    assert 0 <= result["sampled_hr@10"] <= 1 and np.isfinite(result["loss"])
