"""The sparse engine in training: the trainer runs, resumes and evaluates with it, CowClip's
step equals the NumPy algorithm, the noise-scale gradient norms equal the per-table path, and
an error-bound schedule switches the compiled step (split from ``test_engine.py``)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

import dlrm.presets  # noqa: F401
from dlrm import evaluate as dlrm_evaluate
from dlrm.model import build_model
from recscale import sharding
from recscale.config import (
    EmbeddingShardingConfig,
    get_preset,
)
from recscale.train.loop import train
from tests.recscale.test_engine import (
    SCHEMA,
    _batches,
    _build,
    _cfg,
    _initial_tables_and_gradients,
    _run,
)


def test_trainer_resumes_and_evaluates_with_the_engine(tmp_path, capsys):
    cfg = get_preset("dlrm/tiny")
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train,
            num_steps=6,
            checkpoint_every=3,
            log_every=3,
            progress=False,
            noise_scale_every=3,
        ),
        mesh=dataclasses.replace(cfg.mesh, data_parallel=8),
        embeddings=EmbeddingShardingConfig(sharding="row_wise"),
    )
    full = train(cfg, build_model, tmp_path / "full")
    plan = (tmp_path / "full" / "embedding_plan.txt").read_text()
    assert plan.count("row_wise") == len(get_preset("dlrm/tiny").data.synthetic.vocab_sizes), plan
    # The state a run killed after step 3 leaves: checkpoint 3 and the metrics up to it.
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "6")
    rows = [json.loads(r) for r in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "resumed" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 3)
    )
    capsys.readouterr()
    resumed = train(cfg, build_model, tmp_path / "resumed")
    assert "restored checkpoint step 3" in capsys.readouterr().err
    assert resumed == full  # resume is exact
    assert {"dense_param_norm", "grad_norm", "update_norm"} <= set(
        next(r for r in rows if r["split"] == "train")
    )
    # The gradient noise scale, measured before steps 1 and 4 (it changes nothing: the
    # resumed run, whose measurements restart, ends in the same state).
    noise = [r for r in rows if r["split"] == "noise_scale"]
    assert [r["step"] for r in noise] == [0, 3]
    for r in noise:
        assert r["noise_scale/dense/trace"] > 0 and r["noise_scale/embedding/trace"] > 0, r
    capsys.readouterr()
    got = dlrm_evaluate.main(["--workdir", str(tmp_path / "full")])
    for key in ("auc", "logloss", "num_examples", "step"):
        assert got[key] == full[key], key
    # Onto other meshes: the row-wise buffers of 8 devices are re-laid out for 2 and for 1.
    for n in (2, 1):
        other = dlrm_evaluate.main(["--workdir", str(tmp_path / "full"), "--num-devices", str(n)])
        assert other["num_examples"] == full["num_examples"] and other["step"] == 6
        # bags of up to 3 ids are summed across row shards in another order: float32 rounding
        np.testing.assert_allclose(other["logloss"], full["logloss"], rtol=1e-6)
        np.testing.assert_allclose(other["auc"], full["auc"], rtol=1e-6)
    # The curvature of the training loss at the checkpoint (dense parameters, tables fixed).
    curv = dlrm_evaluate.main(
        [
            "--workdir",
            str(tmp_path / "full"),
            "--curvature",
            "--curvature-iters",
            "8",
            "--curvature-batches",
            "1",
            "--curvature-epsilon",
            "1e-3",
            "--curvature-ascent-steps",
            "3",
        ]
    )
    c = curv["curvature"]
    saved = json.loads((tmp_path / "full" / "curvature.json").read_text())
    assert saved["step"] == 6 and saved["top"] == c["top"]
    assert c["top"] == sorted(c["top"], reverse=True) and c["top"][0] > 0
    assert c["min"] <= c["top"][-1] and c["dim"] > 0
    assert c["sharpness"][0]["max_loss"] >= c["sharpness"][0]["loss"]
    # Each table's sensitivity to a compressed exchange, and per-table bounds proposed from it
    # (``recscale.analysis.comm_sensitivity``; its own tests check the numbers).
    sens = dlrm_evaluate.main(
        [
            "--workdir",
            str(tmp_path / "full"),
            "--comm-sensitivity",
            "--comm-sensitivity-batches",
            "1",
        ]
    )["comm_sensitivity"]
    saved = json.loads((tmp_path / "full" / "comm_sensitivity.json").read_text())
    assert saved["step"] == 6 and saved["scales"] == sens["scales"]
    assert sens["base_bound"] == 0.002 and sens["blocks"] == 8 and sens["bits_ratio"] <= 1
    assert len(sens["comm_error_bound_tables"]) == len(sens["tables"]) > 0
    # int8 inference on the engine's (re-laid-out) buffers: close to float32, not equal.
    int8 = dlrm_evaluate.main(
        ["--workdir", str(tmp_path / "full"), "--num-devices", "2", "--embeddings-int8"]
    )
    assert int8["embeddings"] == "int8" and int8["num_examples"] == full["num_examples"]
    assert int8["logloss"] != full["logloss"]
    np.testing.assert_allclose(int8["logloss"], full["logloss"], rtol=1e-3)
    np.testing.assert_allclose(int8["auc"], full["auc"], atol=1e-2)


def _numpy_cowclip(g, w, count, ratio, min_norm, row_l2):
    """CowClip as the paper's Algorithm 1 states it, one row (id) at a time: the L2 term's
    gradient added to each touched row, then the row clipped to cnt · max(r·||w||, ζ)."""
    out, clipped = g.copy(), 0
    for j in np.flatnonzero(count):
        gj = g[j] + row_l2 * w[j]
        limit = count[j] * max(ratio * np.linalg.norm(w[j]), min_norm)
        norm = np.linalg.norm(gj)
        out[j] = gj * min(1.0, limit / norm) if norm > 0 else gj
        clipped += bool(norm > limit)
    return out, clipped


@pytest.mark.parametrize("kind", ["off", "data_parallel", "row_wise", "column_wise"])
def test_cowclip_step_equals_the_numpy_algorithm(kind):
    """One SGD step with CowClip (and the touched rows' L2) on the per-table path and in the
    engine on 8 devices (column-wise: each row's norms summed over its column shards) equals
    NumPy's Algorithm 1 on the dense reference's table gradients, with ids repeated within and
    across bags (counts up to 10)."""
    ratio, min_norm, row_l2, lr = 0.05, 1e-3, 0.01, 0.1
    batches = _batches(1, vocab="hot")
    cfg = _cfg(kind, 1 if kind == "off" else 8, opt="sgd")
    cfg = dataclasses.replace(
        cfg,
        embedding_optim=dataclasses.replace(
            cfg.embedding_optim,
            cowclip_ratio=ratio,
            cowclip_min_norm=min_norm,
            row_l2=row_l2,
        ),
    )
    _, tables1, *_ = _run(cfg, batches)

    specs, start = _initial_tables_and_gradients(batches[0])
    clipped = kept = 0
    for t in specs:
        w0, gt = start[t.name]
        ids = batches[0].ids_bfh[:, int(t.name[1:])].reshape(-1)
        count = np.bincount(ids[ids >= 0], minlength=t.num_rows)
        g_clip, n = _numpy_cowclip(gt, w0, count, ratio, min_norm, row_l2)
        clipped, kept = clipped + n, kept + int((count > 0).sum()) - n
        np.testing.assert_allclose(
            tables1[t.name], w0 - lr * g_clip, rtol=1e-5, atol=1e-6, err_msg=t.name
        )
        assert np.array_equal(tables1[t.name][count == 0], w0[count == 0])  # untouched: bitwise
    assert clipped > 0 and kept > 0, (clipped, kept)  # both branches of the rule are exercised


@pytest.mark.parametrize("kind", ["row_wise", "column_wise"])
def test_gradient_norms_for_the_noise_scale_equal_the_per_table_path(kind):
    """The squared gradient norms the noise scale uses, dense parameters and tables apart: the
    engine's row gradients on 8 devices give the per-table path's table gradient norm, and
    micro-batches of the step's batch run through the same function."""
    from recscale.analysis import noise_scale
    from recscale.train.steps import make_gradient_sq_norms

    batch = _batches(1, vocab="hot")[0]
    got = {}
    for k, n in (("off", 1), (kind, 8)):
        cfg = _cfg(k, n, opt="sgd")
        with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh):
            _, graphdef, state, _ = _build(cfg, SCHEMA, None)
            fn = make_gradient_sq_norms(graphdef, sparse=k != "off")
            got[k] = jax.device_get(
                jax.jit(
                    lambda s, b, fn=fn: noise_scale.micro_batch_sq_norms(lambda x: fn(s, x), b, 2)
                )(state, batch)
            )
    for i in (0, 1):  # micro-batches' mean, whole batch
        for part in ("dense", "embedding"):
            assert got["off"][i][part] > 0
            np.testing.assert_allclose(got[kind][i][part], got["off"][i][part], rtol=1e-5)
    assert (
        got["off"][0]["embedding"] > got["off"][1]["embedding"]
    )  # noise: smaller batch, larger norm


def test_a_schedule_of_error_bounds_switches_the_compiled_step(tmp_path):
    """``comm_error_bound_schedule``: 4-bit codes for 3 steps, then 8-bit. The first 3 steps are
    bitwise the constant 4-bit run's; from step 4 the losses differ; train rows log the bounds."""
    cfg = get_preset("dlrm/tiny")
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train, num_steps=6, log_every=1, checkpoint_every=0, eval_every=0, progress=False
        ),
        mesh=dataclasses.replace(cfg.mesh, data_parallel=8),
        embeddings=EmbeddingShardingConfig(
            sharding="row_wise",
            comm_compression="error_bounded",
            comm_error_bound=0.036,
            comm_error_bound_grad=0.036,
        ),
    )
    sched = dataclasses.replace(
        cfg,
        embeddings=dataclasses.replace(
            cfg.embeddings, comm_error_bound_schedule=("3:0.002:0.002",)
        ),
    )
    # a schedule starting at step 0 replaces the bounds from the start: the constant 8-bit run
    eight = dataclasses.replace(
        cfg,
        embeddings=dataclasses.replace(
            cfg.embeddings, comm_error_bound=0.002, comm_error_bound_grad=0.002
        ),
    )
    from_0 = dataclasses.replace(
        cfg,
        embeddings=dataclasses.replace(
            cfg.embeddings, comm_error_bound_schedule=("0:0.002:0.002",)
        ),
    )
    runs = {}
    for name, c in (("const", cfg), ("sched", sched), ("eight", eight), ("from_0", from_0)):
        train(c, build_model, tmp_path / name)
        runs[name] = [
            json.loads(r)
            for r in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if json.loads(r)["split"] == "train"
        ]
    const = [r["loss"] for r in runs["const"]]
    got = [r["loss"] for r in runs["sched"]]
    assert got[:3] == const[:3] and got[3] != const[3]
    assert [r["comm_error_bound"] for r in runs["sched"]] == [0.036] * 3 + [0.002] * 3
    assert "comm_error_bound" not in runs["const"][0]  # constant bounds: nothing to log
    assert [r["loss"] for r in runs["from_0"]] == [r["loss"] for r in runs["eight"]]
    with pytest.raises(ValueError, match="steps increasing"):
        EmbeddingShardingConfig(
            sharding="row_wise",
            comm_compression="error_bounded",
            comm_error_bound_schedule=("5:0.002:0.002", "5:0.01:0"),
        )
