"""The serving artifact (issue 20): quantizers against NumPy, export/load round trips against
the checkpoint's evaluation for every precision, a loader that needs only jax."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import dlrm.presets  # noqa: F401
from dlrm.config import DLRMConfig
from dlrm.model import build_model
from recscale.config import EmbeddingShardingConfig, get_preset
from recscale.serving import precision as prec
from recscale.serving.export import ExportArgs, export_workdir
from recscale.serving.runtime import ArtifactError, Model
from recscale.train.evaluation import restored
from recscale.train.loop import train

# ------------------------------------------------------------------------------------------------
# Quantizers against NumPy.


def _np_rowwise(x: np.ndarray, levels: int):
    bias = x.min(axis=1, keepdims=True)
    rng = x.max(axis=1, keepdims=True) - bias
    # XLA divides by a constant as a multiplication by its float32 reciprocal (1 ulp from the
    # quotient at most): the quantizers' scale is exactly that product
    scale = np.where(rng > 0, rng * np.float32(1 / levels), np.float32(1)).astype(np.float32)
    q = np.clip(np.round((x - bias) / scale), 0, levels).astype(np.uint8)
    return q, scale, bias


@pytest.mark.parametrize("dim", [7, 8])
def test_int8_and_int4_rowwise_quantizers_equal_numpy(dim):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((50, dim)) * rng.uniform(0.01, 3, (50, 1))).astype(np.float32)
    x[3] = 0.25  # a constant row: scale 1, exact
    for name, levels in (("int8", 255), ("int4", 15)):
        q, scale, bias = _np_rowwise(x, levels)
        e = prec.quantize(x, name)
        np.testing.assert_array_equal(np.asarray(e["scale_bias"]), np.concatenate([scale, bias], 1))
        got = np.asarray(e["q"])
        if name == "int4":  # two codes a byte, the even column low
            assert got.shape == (50, (dim + 1) // 2)
            unpacked = np.stack([got & 15, got >> 4], axis=-1).reshape(50, -1)[:, :dim]
            np.testing.assert_array_equal(unpacked, q)
            assert not (got[:, -1] >> 4).any() if dim % 2 else True  # the odd tail's pad is 0
        else:
            np.testing.assert_array_equal(got, q)
        deq = np.asarray(prec.dequantize(e, name, dim))
        np.testing.assert_allclose(deq, q * scale + bias, rtol=1e-6, atol=1e-7)
        # every value within half a step of its row's grid
        assert (np.abs(deq - x) <= scale / 2 * (1 + 1e-5) + 1e-7).all()
        np.testing.assert_array_equal(deq[3], x[3])
    for name in ("bfloat16", "float16"):
        e = prec.quantize(x, name)
        np.testing.assert_array_equal(np.asarray(e["w"]), x.astype(prec.FLOATS[name]))
    assert prec.nbytes(prec.quantize(x, "int4")) == 50 * ((dim + 1) // 2 + 8)
    with pytest.raises(ValueError, match="precision 'int2'"):
        prec.quantize(x, "int2")


def test_pooled_lookup_equals_numpy_on_dequantized_rows():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 6)).astype(np.float32)
    ids = rng.integers(-1, 34, (20, 4)).astype(np.int32)  # -1 and >= 30: padding
    for name in prec.PRECISIONS:
        e = prec.quantize(x, name)
        table = np.asarray(prec.dequantize(e, name, 6))
        valid = (ids >= 0) & (ids < 30)
        want = np.where(valid[..., None], table[np.clip(ids, 0, 29)], 0).sum(1)
        got = prec.pool(e, name, ids, dim=6)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6, err_msg=name)
        mean = prec.pool(e, name, ids, dim=6, pooling="mean")
        counts = np.maximum(valid.sum(1, keepdims=True), 1)
        np.testing.assert_allclose(np.asarray(mean), want / counts, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Export and load.


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """dlrm/tiny trained 20 steps with its tables row-wise on 8 devices (the engine)."""
    wd = tmp_path_factory.mktemp("serving") / "run"
    cfg = get_preset("dlrm/tiny")
    cfg = dataclasses.replace(cfg, embeddings=EmbeddingShardingConfig(sharding="row_wise"),
                              train=dataclasses.replace(cfg.train, progress=False))  # fmt: skip
    train(cfg, build_model, wd, argv=["-m", "dlrm.train", "dlrm/tiny"])
    return wd


def _reference(run_dir):
    """The checkpoint's evaluation: probabilities of every eval example, and the inputs."""
    with restored(DLRMConfig, build_model, run_dir, num_devices=8) as r:
        dense, ids, probs = [], [], []
        for b in r.exp.source.eval_batches():
            logits = r.exp._eval_step(r.params, r.batch_stats, r.exp.device_batch(b))
            probs.append(np.asarray(jax.nn.sigmoid(logits)))
            dense.append(b.dense_bn)
            ids.append(b.ids_bfh)
    return np.concatenate(dense), np.concatenate(ids), np.concatenate(probs)


# Largest difference of a probability from float32's evaluation, per precision (measured on
# this run: float32 6e-8, the engine's row-wise partial sums added in another order; bf16
# 4.3e-4; fp16 5.6e-5; int8 4.4e-4; int4 7.8e-3); allowed: about 2.5x that.
PROB_ATOL = {"float32": 1e-6, "bfloat16": 1.1e-3, "float16": 1.5e-4, "int8": 1.1e-3, "int4": 2e-2}


def test_export_and_load_give_the_evaluation_scores_for_every_precision(run_dir, tmp_path):
    dense, ids, want = _reference(run_dir)
    sizes = {}
    for p in prec.PRECISIONS:
        out = tmp_path / p
        man = export_workdir(DLRMConfig, build_model,
                             ExportArgs(workdir=str(run_dir), out=str(out), precision=p),
                             family="dlrm")  # fmt: skip
        assert man["source"]["step"] == 20
        assert {t["precision"] for t in man["tables"].values()} == {p}
        sizes[p] = man["table_bytes"]
        model = Model.load(out)
        got = model.predict(dense, ids)
        assert got.shape == want.shape and got.dtype == np.float32
        err = np.abs(got - want).max()
        print(f"{p}: largest probability difference {err:.3g}")
        assert err <= PROB_ATOL[p], (p, err)
        if p != "float32":
            assert err > 0, p  # the tables really are in that precision
        # any batch size (a symbolic batch, padded to powers of two): the same scores
        np.testing.assert_allclose(model.predict(dense[:5], ids[:5]), got[:5], rtol=1e-6)
    # bytes of the 380 rows of D = 8: 2 a value in bf16/fp16, 1 (int8) or 1/2 (int4) plus a
    # float32 scale and bias a row
    rows = sizes["float32"] // (4 * 8)
    assert rows == 100 + 50 + 200 + 30
    assert sizes["bfloat16"] == sizes["float16"] == rows * 2 * 8
    assert (sizes["int8"], sizes["int4"]) == (rows * (8 + 8), rows * (4 + 8))


def test_per_table_precisions_and_the_jax_only_loader(run_dir, tmp_path):
    dense, ids, want = _reference(run_dir)
    out = tmp_path / "mixed"
    man = export_workdir(DLRMConfig, build_model,
                         ExportArgs(workdir=str(run_dir), out=str(out), precision="int8",
                                    table_precision=("f0=float32", "f1=int4"),
                                    platforms=("cpu", "cuda", "tpu")),
                         family="dlrm")  # fmt: skip
    assert [man["tables"][t]["precision"] for t in ("f0", "f1", "f2")] == [
        "float32",
        "int4",
        "int8",
    ]
    assert man["platforms"] == ["cpu", "cuda", "tpu"]  # lowered for all three from this CPU host
    in_process = Model.load(out).predict(dense, ids)
    np.testing.assert_allclose(in_process, want, atol=PROB_ATOL["int4"])
    # A fresh interpreter with the artifact's own loader: only numpy and jax get imported.
    np.savez(tmp_path / "inputs.npz", dense=dense, ids=ids)
    code = textwrap.dedent(f"""
        import sys, json, numpy as np
        sys.path.insert(0, {str(out)!r})
        from recscale_model import Model
        z = np.load({str(tmp_path / "inputs.npz")!r})
        m = Model.load({str(out)!r})
        np.save({str(tmp_path / "scores.npy")!r}, m.predict(z["dense"], z["ids"]))
        print(json.dumps(sorted({{k.split(".")[0] for k in sys.modules}} & {{"recscale", "flax", "dlrm", "optax"}})))
    """)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, check=True)  # fmt: skip
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
    np.testing.assert_array_equal(np.load(tmp_path / "scores.npy"), in_process)


def test_loader_errors_and_out_of_vocabulary_ids(run_dir, tmp_path):
    dense, ids, _ = _reference(run_dir)
    out = tmp_path / "m"
    export_workdir(DLRMConfig, build_model, ExportArgs(workdir=str(run_dir), out=str(out)))
    model = Model.load(out)
    base = model.predict(dense[:4], ids[:4])
    bad = ids[:4].copy()
    vocab = model.features[0]["vocab_size"]
    bad[0, 0, 0] = vocab  # out of vocabulary: a missing id, counted
    bad[1, 0, 0] = -7
    before = model.counters["out_of_vocab_ids"]
    masked = ids[:4].copy()
    masked[0, 0, 0] = masked[1, 0, 0] = -1
    np.testing.assert_array_equal(model.predict(dense[:4], bad), model.predict(dense[:4], masked))
    assert model.counters["out_of_vocab_ids"] == before + 2
    assert not np.array_equal(base, model.predict(dense[:4], masked))
    with pytest.raises(ArtifactError, match=r"ids: expected \[B, 4, H <= "):
        model.predict(dense[:4], ids[:4, :2])
    with pytest.raises(ArtifactError, match="dense: expected"):
        model.predict(dense[:4, :1], ids[:4])
    with pytest.raises(ArtifactError, match="ids: expected integers"):
        model.predict(dense[:4], ids[:4].astype(np.float32))
    with pytest.raises(ArtifactError, match="manifest.json: not found"):
        Model.load(tmp_path / "nope")
    man = json.loads((out / "manifest.json").read_text())
    name = next(iter(man["weights"]))
    man["weights"][name]["shape"] = [1, 2, 3]
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match=f"weight {name!r} has shape"):
        Model.load(out)
