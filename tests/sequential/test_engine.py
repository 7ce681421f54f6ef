"""The sequential families' item table in the sharded embedding engine (``sequential.task``'s
one lookup per step, the engine's sparse row updates, the table gathered for evaluation) equals
the per-table path on the 8-device CPU mesh, to float32 rounding:

- SASRec's BCE with SGD, row-wise (and its evaluation: the full ranking over the gathered
  table, the full-softmax loss);
- HSTU's sampled softmax with row-wise Adagrad, table-wise (both update only the rows a step
  read, as the per-table optax path leaves untouched rows where they are);
- the full softmax with Adam, data-parallel: it reads every row every step, so the engine's
  lazy Adam is the per-table path's dense one. With a sampled loss they differ after the
  first step: dense Adam keeps moving the rows a previous step touched (their moments decay,
  their updates do not vanish), lazy Adam moves only the rows the step read.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from recscale import families, sharding
from recscale.config import DenseOptimConfig, EmbeddingShardingConfig, get_preset
from recscale.embeddings import engine
from recscale.train.experiment import Experiment, schedule_args, train_programs
from sequential.config import LossConfig

STEPS = 3
FAMILIES = {name: families.load(name) for name in ("hstu", "sasrec")}  # registers the presets
TOL = dict(rtol=2e-5, atol=2e-6)
"""Float32 rounding: the engine sums a row's repeated gradients by its row-gradient scatter,
the per-table path by the gather's transpose, and a row-wise lookup adds zero partial sums
from the other shards; 3 steps compound it (measured: below 3e-7)."""


def _run(name: str, sharding_kind: str, opt: str, *, loss=None, evaluate=False):
    """``STEPS`` steps of ``name/tiny``: the losses, the item table ``[V + 1, D]``, the dense
    parameters and (``evaluate``) one evaluation step's metrics."""
    cfg = get_preset(f"{name}/tiny")
    cfg = dataclasses.replace(
        cfg,
        loss=loss or cfg.loss,
        embeddings=EmbeddingShardingConfig(sharding=sharding_kind),
        embedding_optim=dataclasses.replace(cfg.embedding_optim, name=opt, learning_rate=0.05),
        # SGD: Adam would turn the dense gradients that are 0 but for rounding (the attention
        # key bias's: a softmax ignores a constant) into steps of +-lr either way.
        dense_optim=DenseOptimConfig(name="sgd", learning_rate=0.05, b1=0.0),
    )
    fam = FAMILIES[name]
    with sharding.activate(sharding.make_mesh(cfg.mesh), cfg.mesh):
        exp = Experiment.build(cfg, fam.build_model)
        state = exp.init_state()
        initial = _item_table(exp, state)
        step, _ = train_programs(cfg, fam.build_model, exp)
        args = {**schedule_args(cfg), **exp.task.step_args(exp.source)}
        losses = []
        for s in range(STEPS):
            state, m = step(state, exp.device_batch(exp.source.train_batch(s)), args)
            assert float(m["nonfinite"]) == 0.0  # a skipped step would move nothing
            losses.append(float(m["loss"]))
        result = exp.evaluate(state.params, state.batch_stats, max_batches=1) if evaluate else {}
        table = _item_table(exp, state)
        layout = nnx.merge(exp.graphdef, state.params, state.batch_stats).embeddings.layout
        dense = {
            "/".join(map(str, p)): np.asarray(v[...])
            for p, v in nnx.to_flat_state(state.params)
            if p[0] != "embeddings"
        }
        return {
            "losses": losses,
            "table": table,
            "dense": dense,
            "eval": result,
            "layout": None if layout is None else layout.plan_text,
            "moved": not np.array_equal(initial, table),
        }


def _item_table(exp, state) -> np.ndarray:
    """The item table ``[V + 1, D]`` of ``state`` (the engine's exported from its buffers)."""
    emb = nnx.merge(exp.graphdef, state.params, state.batch_stats).embeddings
    if emb.layout is None:
        return np.array(emb.tables["item"][...])[: emb.table_specs[0].num_rows]  # a copy
    bufs = {k: v[...] for k, v in emb.buffers.items()}
    return engine.export_tables(emb.layout, bufs, emb.table_specs, emb.feature_specs)["item"]


def _assert_equal_runs(ref: dict, got: dict, sharding_kind: str) -> None:
    assert ref["layout"] is None and sharding_kind in got["layout"]
    assert ref["moved"] and got["moved"], "the item table must have moved"
    np.testing.assert_allclose(got["losses"], ref["losses"], **TOL)
    np.testing.assert_allclose(got["table"], ref["table"], **TOL, err_msg="item table")
    assert sorted(got["dense"]) == sorted(ref["dense"])
    for k, v in ref["dense"].items():
        np.testing.assert_allclose(got["dense"][k], v, **TOL, err_msg=k)


def test_sasrec_bce_sgd_row_wise_equals_the_per_table_path():
    ref = _run("sasrec", "off", "sgd", evaluate=True)
    got = _run("sasrec", "row_wise", "sgd", evaluate=True)
    _assert_equal_runs(ref, got, "row_wise")
    ev, ev_ref = got["eval"], ref["eval"]
    assert ev["num_examples"] == ev_ref["num_examples"] > 0
    for k in ("loss", "hr@10", "ndcg@10", "hr@50", "mrr"):
        np.testing.assert_allclose(ev[k], ev_ref[k], **TOL, err_msg=k)


def test_hstu_sampled_softmax_rowwise_adagrad_table_wise_equals_the_per_table_path():
    ref = _run("hstu", "off", "rowwise_adagrad")
    _assert_equal_runs(ref, _run("hstu", "table_wise", "rowwise_adagrad"), "table_wise")


def test_full_softmax_lazy_adam_data_parallel_equals_the_dense_adam():
    loss = LossConfig(kind="full_softmax")
    ref = _run("sasrec", "off", "adam", loss=loss)
    _assert_equal_runs(ref, _run("sasrec", "data_parallel", "adam", loss=loss), "data_parallel")
