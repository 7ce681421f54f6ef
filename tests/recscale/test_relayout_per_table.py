"""A per-table checkpoint (``embeddings.sharding=off``, the reference path) converts to the
engine's layout: its parameters move bitwise into the engine's buffers (``train.init_from``,
evaluation), a resume across the switch is refused with the way out named."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

import dlrm.presets  # noqa: F401
from dlrm.model import build_model
from recscale import sharding
from recscale.config import EmbeddingShardingConfig, get_preset
from recscale.embeddings import relayout
from recscale.serving.export import float_tables
from recscale.train.checkpoint import Checkpointer
from recscale.train.loop import Experiment, train


def _cfg(kind: str, n: int, **train):
    cfg = get_preset("dlrm/tiny")
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, data_parallel=n),
        embeddings=EmbeddingShardingConfig(sharding=kind),
        train=dataclasses.replace(cfg.train, **{"progress": False, "num_steps": 4, **train}),
    )


def _params(exp, params, batch_stats) -> dict[str, np.ndarray]:
    model = nnx.merge(exp.graphdef, params, batch_stats)
    out = {f"table/{k}": v for k, v in float_tables(model.embeddings).items()}
    for path, v in nnx.to_flat_state(params):
        if "embeddings" not in path:
            out["/".join(map(str, path))] = np.asarray(jax.device_get(v[...]))
    return out


@pytest.fixture(scope="module")
def per_table_run(tmp_path_factory):
    wd = tmp_path_factory.mktemp("per_table")
    train(_cfg("off", 1), build_model, wd)
    return wd


def test_a_per_table_checkpoint_converts_bitwise_into_the_engine(per_table_run):
    old, new = _cfg("off", 1), _cfg("row_wise", 8)
    ckpt = Checkpointer(per_table_run / "checkpoints", async_save=False)
    try:
        saved = ckpt.read_meta(4)["layout"]
        assert saved["engine"] is None
        with sharding.activate(sharding.make_mesh(old.mesh), old.mesh):
            exp = Experiment.build(old, build_model, with_optimizer=False)
            a = exp.abstract_state
            trees, _ = ckpt.restore(4, {"params": a.params, "batch_stats": a.batch_stats})
            want = _params(exp, trees["params"], trees["batch_stats"])
        with sharding.activate(sharding.make_mesh(new.mesh), new.mesh):
            exp = Experiment.build(new, build_model, with_optimizer=False)
            assert relayout.needs_relayout(saved, new)
            got = relayout.restore_relaid(
                ckpt, 4, exp, new, build_model, saved, with_opt_state=False
            )
            assert exp.graphdef is not None and got["opt_state"] is None
            got = _params(exp, got["params"], got["batch_stats"])
            layout = nnx.merge(exp.graphdef, exp.abstract_state.params).embeddings.layout
            assert layout is not None and not layout.buffers[0].replicated
    finally:
        ckpt.close()
    assert got.keys() == want.keys() and any(k.startswith("table/") for k in got)
    for k, v in want.items():
        assert got[k].tobytes() == v.tobytes(), k


def test_init_from_a_per_table_run_starts_the_engine_from_its_parameters(per_table_run, tmp_path):
    """An engine run initialised from the per-table run evaluates, before any step, as the
    per-table run's last evaluation (same parameters, another layout: float32 summation
    order only)."""
    last = [
        json.loads(x)
        for x in (per_table_run / "metrics.jsonl").read_text().splitlines()
        if json.loads(x)["split"] == "eval"
    ][-1]
    cfg = _cfg("auto", 8, num_steps=0, init_from=str(per_table_run))
    train(cfg, build_model, tmp_path / "engine")
    rows = [json.loads(x) for x in (tmp_path / "engine" / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if r["split"] == "eval"][-1]
    np.testing.assert_allclose(ev["logloss"], last["logloss"], rtol=1e-5)
    np.testing.assert_allclose(ev["auc"], last["auc"], rtol=1e-5)


def test_resuming_across_the_switch_is_refused_naming_init_from(per_table_run):
    ckpt = Checkpointer(per_table_run / "checkpoints", async_save=False)
    saved = ckpt.read_meta(4)["layout"]
    ckpt.close()
    with pytest.raises(ValueError, match="train.init_from"):
        relayout.check_relayout(saved, _cfg("auto", 8))
