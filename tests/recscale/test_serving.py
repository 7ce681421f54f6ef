"""The serving artifact (issue 20): quantizers against NumPy, export/load round trips against
the checkpoint's evaluation for every precision, a loader that needs only jax."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
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
from recscale.kernels.quantized_embedding_bag import precision as prec
from recscale.serving.export import ExportArgs, choose_precisions, export_workdir
from recscale.serving.runtime import ArtifactError, Model
from recscale.train.evaluation import restored
from recscale.train.loop import train
from recscale.train.steps import weighted_bce

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
    cfg = dataclasses.replace(
        cfg,
        embeddings=EmbeddingShardingConfig(sharding="row_wise"),
        train=dataclasses.replace(cfg.train, progress=False),
    )
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
        man = export_workdir(
            DLRMConfig,
            build_model,
            ExportArgs(workdir=str(run_dir), out=str(out), precision=p),
            family="dlrm",
        )
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
    man = export_workdir(
        DLRMConfig,
        build_model,
        ExportArgs(
            workdir=str(run_dir),
            out=str(out),
            precision="int8",
            table_precision=("f0=float32", "f1=int4"),
            platforms=("cpu", "cuda", "tpu"),
        ),
        family="dlrm",
    )
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
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=True,
    )
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
    np.testing.assert_array_equal(np.load(tmp_path / "scores.npy"), in_process)


def test_loader_errors_and_out_of_vocabulary_ids(run_dir, tmp_path):
    dense, ids, _ = _reference(run_dir)
    out = tmp_path / "m"
    # an export never replaces the run, a folder above it or one that is not an artifact
    for bad_out in (run_dir, run_dir / "checkpoints", run_dir.parent, tmp_path):
        with pytest.raises(ValueError, match="--out"):
            export_workdir(
                DLRMConfig, build_model, ExportArgs(workdir=str(run_dir), out=str(bad_out))
            )
    assert (run_dir / "config.json").is_file()
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


# ------------------------------------------------------------------------------------------------
# The HTTP server.


@pytest.fixture(scope="module")
def artifact(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifact") / "m"
    export_workdir(DLRMConfig, build_model, ExportArgs(workdir=str(run_dir), out=str(out)))
    return out


def _serve(model, requests, **kw):
    """Runs ``requests(client) -> result`` against the app on a real localhost socket."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from recscale.serving.server import make_app

    async def main():
        async with TestClient(TestServer(make_app(model, **kw))) as client:
            return await requests(client)

    return asyncio.run(main())


def _examples(dense, ids):
    return [
        {
            "dense": [float(x) for x in d],
            "features": {f"f{j}": [int(v) for v in ids[i, j] if v >= 0] for j in range(4)},
        }
        for i, d in enumerate(dense)
    ]


def test_the_server_answers_and_batches_concurrent_requests(run_dir, artifact):
    import asyncio

    dense, ids, _ = _reference(run_dir)
    dense, ids = dense[:48], ids[:48]
    model = Model.load(artifact)
    want = model.predict(dense, ids)

    async def requests(client):
        async def one(i):
            r = await client.post(
                "/predict", json={"examples": _examples(dense[i : i + 1], ids[i : i + 1])}
            )
            assert r.status == 200, await r.text()
            return (await r.json())["scores"][0]

        got = await asyncio.gather(*(one(i) for i in range(48)))
        arrays = await client.post(
            "/predict", json={"dense": dense[:3].tolist(), "ids": ids[:3].tolist()}
        )
        stats = await (await client.get("/metrics")).json()
        health = await (await client.get("/healthz")).json()
        return got, (await arrays.json())["scores"], stats, health

    async def start(client):  # a model slower than the requests' arrival: they queue, and
        import time as time_lib  # batch, however loaded the machine is

        from recscale.serving.server import BATCHER

        fast = model.predict_checked

        def predict(dense, ids):
            time_lib.sleep(0.05)
            return fast(dense, ids)

        client.server.app[BATCHER].predict = predict
        return await requests(client)

    got, arrays, stats, health = _serve(model, start, max_batch=16, max_wait=0.05)
    # batched with other requests (padded to powers of two): the same scores to float rounding
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(arrays, want[:3], rtol=1e-6, atol=1e-7)
    assert health == {"ok": True}
    assert stats["requests"] == 49 and stats["examples"] == 51 and stats["shed"] == 0
    assert stats["batches"] < 20 and 1 < stats["mean_batch"] <= 16, stats


def test_the_server_sheds_load_beyond_its_queue_with_503(artifact):
    import asyncio
    import time as time_lib

    model = Model.load(artifact)
    slow = model.predict_checked

    def predict(dense, ids):  # a slow model: the queue fills
        time_lib.sleep(0.2)
        return slow(dense, ids)

    dense, ids = np.zeros((1, 4), np.float32), np.full((1, 4, 3), -1, np.int32)
    ids[:, :, 0] = 0  # one id per bag

    async def requests(client):
        from recscale.serving.server import BATCHER

        client.server.app[BATCHER].predict = predict

        async def one():
            r = await client.post("/predict", json={"dense": dense.tolist(), "ids": ids.tolist()})
            return r.status, await r.json()

        res = await asyncio.gather(*(one() for _ in range(30)))
        stats = await (await client.get("/metrics")).json()
        return res, stats

    res, stats = _serve(model, requests, max_batch=2, max_wait=0.0, max_queue=4)
    codes = [c for c, _ in res]
    assert set(codes) == {200, 503}
    shed = [body["error"] for c, body in res if c == 503]
    assert all("overloaded" in e and "max 4" in e for e in shed)
    assert stats["shed"] == len(shed) >= 20 and stats["queued_examples"] == 0
    # at most 4 examples ever waited (2 batches of 2 at 0.2 s each), not 30
    assert codes.count(200) <= 6, codes.count(200)


def test_the_server_rejects_malformed_requests_clearly(artifact):
    model = Model.load(artifact)
    ok = {"dense": [0.1, 0.2, 0.3, 0.4], "features": {"f0": 3, "f1": [1, 2]}}

    async def requests(client):
        out = []
        for body in (
            b"{not json",
            {"examples": [{**ok, "features": {"nope": 1}}]},
            {"examples": [{**ok, "features": {"f0": "x"}}]},
            {"examples": [{**ok, "features": {"f1": [1, 2, 3]}}]},
            {"examples": [{"dense": {"d0": 1.0}, "features": {}}]},
            {"examples": [ok], "extra": 1},
            {"dense": [[0.0] * 4], "ids": [[[0.5]] * 4]},
            {"dense": [[None] * 4], "ids": [[[0]] * 4]},
            b'{"dense": [[NaN, 0, 0, 0]], "ids": [[[0], [0], [0], [0]]]}',
            {"dense": [[0.0] * 4], "ids": [[[0], [0, 1], [0], [0]]]},
            {"dense": [[0.0] * 4], "ids": [[[-1, 0], [0, -1], [0, -1], [0, -1]]]},
            b'{"examples": [{"dense": [1' + b"0" * 400 + b", 0, 0, 0]}]}",  # an int past float
            {"examples": [ok, {**ok, "features": {"f0": 10_000, "f1": 2**70}}]},
        ):
            kw = {"data": body} if isinstance(body, bytes) else {"json": body}
            r = await client.post("/predict", **kw)
            out.append((r.status, await r.json()))
        stats = await (await client.get("/metrics")).json()
        return out, stats

    out, stats = _serve(model, requests)
    codes = [c for c, _ in out]
    assert codes == [400] * 12 + [200], out
    msgs = [b.get("error", "") for _, b in out]
    assert "not JSON" in msgs[0]
    assert "example 0: unknown feature 'nope'" in msgs[1]
    assert "example 0: feature 'f0': ids are integers, got str" in msgs[2]
    assert "feature 'f1' has 3 values, at most 2" in msgs[3]
    assert "example 0: dense feature 'd1' is missing" in msgs[4]
    assert 'expected {"examples": [...]} and nothing else' in msgs[5]
    assert "ids: expected integers, got float64" in msgs[6]
    assert "dense: expected numbers, got object" in msgs[7]
    assert "dense: example 0, 'd0' is not finite (nan)" in msgs[8]
    assert "ids: not an array of integers" in msgs[9]  # a ragged array
    assert "ids: example 0, feature 'f0' has more than its 1 ids" in msgs[10]
    assert msgs[11].startswith("example 0: dense feature 'd0': 1000") and "out of range" in msgs[11]
    assert len(out[12][1]["scores"]) == 2 and out[12][1]["missing_features"] == 2 + 2
    assert stats["malformed"] == 12 and stats["out_of_vocab_ids"] == 2, stats


def test_an_artifact_with_an_unknown_encoding_is_refused(artifact, tmp_path):
    out = tmp_path / "v"
    shutil.copytree(artifact, out)
    man = json.loads((out / "manifest.json").read_text())
    assert man["vocab"] is None  # synthetic data: encoded inputs only
    man["vocab"] = {"kind": "sorted_values"}  # session 7's Frappe format, now a tabular/1 one
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match="'sorted_values' is not supported .* export the model"):
        Model.load(out)


def test_the_loader_names_the_package_jax_export_needs(artifact, tmp_path, monkeypatch, capsys):
    from recscale.serving import runtime

    monkeypatch.setitem(sys.modules, "flatbuffers", None)  # as where it is not installed
    with pytest.raises(ArtifactError, match=r"forward\.jax needs .*: pip install flatbuffers$"):
        Model.load(artifact)
    rows = tmp_path / "rows.csv"
    rows.write_text("x\n1\n")
    capsys.readouterr()
    assert runtime.main([str(artifact), str(rows)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "pip install flatbuffers" in err[0]


def test_auto_precision_keeps_the_auc_budget(run_dir, tmp_path):
    loose = export_workdir(
        DLRMConfig,
        build_model,
        ExportArgs(
            workdir=str(run_dir),
            out=str(tmp_path / "a"),
            precision="auto",
            auc_budget=1.0,
            auto_candidates=("int8", "int4"),
            table_precision=("f3=bfloat16",),
        ),
        log=lambda _: None,
    )
    # all the smallest, but the pinned table
    assert [loose["tables"][t]["precision"] for t in ("f0", "f1", "f2", "f3")] == [
        "int4",
        "int4",
        "int4",
        "bfloat16",
    ]
    auto = loose["auto_precision"]
    assert set(auto["solo"]) == {"f0", "f1", "f2"}  # the pinned table is not searched
    assert all(set(v) == {"int4", "int8"} for v in auto["solo"].values())
    strict = export_workdir(
        DLRMConfig,
        build_model,
        ExportArgs(workdir=str(run_dir), out=str(tmp_path / "s"), precision="auto", auc_budget=0.0),
        log=lambda _: None,
    )["auto_precision"]
    # the combination chosen through the probe, measured on the serving model itself: within
    # the budget up to the probe's float32 rounding
    assert strict["auc_cost"] <= 1e-6, strict
    assert strict["bytes"] <= strict["bytes_float32"]
    # the artifact's own AUC is the one reported
    dense, ids, _ = _reference(run_dir)
    with restored(DLRMConfig, build_model, run_dir, num_devices=1) as r:
        batches = list(r.exp.source.eval_batches())
    labels = np.concatenate([b.labels_b for b in batches])
    weights = np.concatenate([b.weights_b for b in batches])  # 0: the last batch's padding
    from recscale.metrics import auc

    got = auc(Model.load(tmp_path / "s").predict(dense, ids), labels, weights)
    np.testing.assert_allclose(got, strict["auc"], atol=1e-6)


def test_the_batcher_is_fifo_across_workers_and_fails_what_it_cannot_answer():
    import asyncio
    import time as time_lib

    from recscale.serving.batcher import DynamicBatcher

    calls = []  # (start, end) of each batch

    def slow(dense, ids):
        t = time_lib.perf_counter()
        time_lib.sleep(0.3)
        calls.append((t, time_lib.perf_counter()))
        return dense[:, 0]

    async def main():
        b = DynamicBatcher(slow, max_batch=4, max_wait=0.0, workers=2)
        b.start()
        t0 = time_lib.perf_counter()
        done = {}

        async def req(name, n, delay):
            await asyncio.sleep(delay)
            x = np.full((n, 1), float(n), np.float32)
            out = await b.score(x, np.zeros((n, 1, 1), np.int32))
            done[name] = time_lib.perf_counter() - t0
            return out

        outs = await asyncio.gather(req("r1", 3, 0), req("r2", 3, 0.01), req("r3", 1, 0.1))
        # a request held back from a full batch is served before a later one, on the free
        # worker: its batch starts while the first is still being scored
        assert done["r2"] <= done["r3"], done
        (s1, e1), (s2, _) = sorted(calls)[:2]
        assert s2 < e1, calls
        assert [o.tolist() for o in outs] == [[3.0] * 3, [3.0] * 3, [1.0]]
        # closing answers every waiting request with an error, and refuses new ones
        pending = [asyncio.create_task(req(f"p{i}", 4, 0)) for i in range(4)]
        await asyncio.sleep(0.05)
        await b.close()
        res = await asyncio.gather(*pending, return_exceptions=True)
        assert sum(isinstance(r, RuntimeError) and "closed" in str(r) for r in res) >= 2, res
        assert all(isinstance(r, np.ndarray | RuntimeError) for r in res)
        assert b.stats.queued_examples == 0
        with pytest.raises(RuntimeError, match="closed"):
            await b.score(np.zeros((1, 1), np.float32), np.zeros((1, 1, 1), np.int32))

    asyncio.run(main())


def test_a_model_with_several_embedding_collections_exports(tmp_path):
    """FinalMLP's stream-1 gate reads f0 through a collection of its own (tables named like the
    main one's): both are exported in the precision asked, and its per-table sensitivity sums
    both lookups of f0."""
    import baselines.finalmlp.presets  # noqa: F401
    from baselines.finalmlp.config import FinalMLPConfig
    from baselines.finalmlp.model import build_model as build_finalmlp
    from recscale.analysis import comm_sensitivity

    wd = tmp_path / "run"
    cfg = get_preset("finalmlp/tiny")
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, num_steps=5, progress=False)
    )
    train(cfg, build_finalmlp, wd, argv=["-m", "baselines.finalmlp.train", "finalmlp/tiny"])
    man = export_workdir(
        FinalMLPConfig,
        build_finalmlp,
        ExportArgs(workdir=str(wd), out=str(tmp_path / "m"), precision="int8"),
    )
    rows = 100 + 50 + 200 + 30
    assert man["table_bytes"] == (rows + 100) * (8 + 8)  # f0's table twice: main and gate
    with restored(FinalMLPConfig, build_finalmlp, wd, num_devices=1) as r:
        batches = list(r.exp.source.eval_batches())
        want = np.concatenate(
            [
                np.asarray(
                    jax.nn.sigmoid(r.exp._eval_step(r.params, r.batch_stats, r.exp.device_batch(b)))
                )
                for b in batches
            ]
        )
        train_batches = [r.exp.device_batch(r.exp.source.train_batch(i)) for i in range(2)]
        sens = comm_sensitivity.measure(
            r.exp.graphdef,
            r.params,
            r.batch_stats,
            train_batches,
            blocks=8,
            loss_fn=lambda logits, b: weighted_bce(logits, b.labels_b, b.weights_b),
        )
        # auto precision: the probe's AUC of every table in int4 (each lookup's delta from its
        # own collection's f0) is the int4 serving model's
        auto = choose_precisions(
            r.exp,
            r.exp.graphdef,
            r.params,
            r.batch_stats,
            ["f0", "f1", "f2", "f3"],
            budget=1.0,
            candidates=("int4",),
            log=lambda _: None,
        )
    dense = np.concatenate([b.dense_bn for b in batches])
    ids = np.concatenate([b.ids_bfh for b in batches])
    got = Model.load(tmp_path / "m").predict(dense, ids)
    np.testing.assert_allclose(got, want, atol=PROB_ATOL["int8"])
    assert sens["f0"]["features"] == ["f0", "f0#2"] and sens["f1"]["features"] == ["f1"]
    assert auto["precisions"] == dict.fromkeys(["f0", "f1", "f2", "f3"], "int4")
    assert auto["tried"][-1]["kept"] and abs(auto["tried"][-1]["auc"] - auto["auc"]) < 1e-6
    assert auto["bytes"] == (rows + 100) * (4 + 8) and auto["auc"] != auto["auc_float32"]


def test_a_feature_spec_run_scores_raw_rows(tmp_path, capsys):
    """A run on a feature spec (with side tables) exports its whole encoding: the artifact
    scores raw rows (the join keys in, side columns from the artifact) as the checkpoint scores
    the rows ``prepare`` encoded, in process, over HTTP, and from a file with the jax-only
    loader's command line."""
    from data.config import TabularConfig
    from data.tabular import example, prepare
    from recscale.serving.runtime import read_rows

    shop = tmp_path / "shop"
    example.make(str(shop), rows=2000)
    (shop / "spec.yaml").write_text(example.SPEC)
    lines = (shop / "new.csv").read_text().splitlines()
    (shop / "later.csv").write_text("\n".join(lines[:257]) + "\n")  # a header and 256 rows
    cfg = get_preset("dlrm/tiny")
    tab = TabularConfig(spec=str(shop / "spec.yaml"), prepared_dir=str(shop / "prep"))
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(
            cfg.data, kind="tabular", batch_size=64, eval_batch_size=256, tabular=tab
        ),
        train=dataclasses.replace(cfg.train, num_steps=3, progress=False),
    )
    wd, out = tmp_path / "run", tmp_path / "m"
    train(cfg, build_model, wd)
    man = export_workdir(DLRMConfig, build_model, ExportArgs(workdir=str(wd), out=str(out)))
    assert man["vocab"]["kind"] == "tabular/1" and (out / "vocab.npz").is_file()
    want_batch, _ = prepare(tab.spec, tab.prepared_dir, progress=False).encode_file(
        str(shop / "later.csv")
    )
    with restored(DLRMConfig, build_model, wd, num_devices=8) as r:
        logits = r.exp._eval_step(r.params, r.batch_stats, r.exp.device_batch(want_batch))
        want = np.asarray(jax.nn.sigmoid(logits))
    model = Model.load(out)
    rows = list(read_rows(shop / "later.csv", man["vocab"]["format"], model.rows.columns))
    dense, ids, counts = model.encode(rows)
    np.testing.assert_array_equal(ids, want_batch.ids_bfh)
    np.testing.assert_array_equal(dense, want_batch.dense_bn)
    got = model.predict(dense, ids)
    np.testing.assert_allclose(got, want, atol=PROB_ATOL["float32"])
    assert counts["unseen_values"] > 0  # later users never seen in training

    async def requests(client):  # whole rows of the file: its unread columns come along
        whole = list(read_rows(shop / "later.csv", man["vocab"]["format"]))[:5]
        r = await client.post("/predict", json={"examples": whole})
        bad = await client.post("/predict", json={"examples": [{"user_id": "u1", "age": 30}]})
        return (r.status, await r.json()), (bad.status, await bad.json()), whole

    (status, body), (bad_status, bad_body), whole = _serve(model, requests)
    assert {"timestamp", "rating"} <= set(whole[0])  # unread by the spec, or the label
    assert status == 200 and np.allclose(body["scores"], got[:5], atol=1e-6)
    assert bad_status == 400 and "column 'age' comes from side table" in bad_body["error"]
    # the command line names a bad row's file and line, and leaves no partial scores file
    bad_file = tmp_path / "bad.csv"
    text = (shop / "later.csv").read_text().splitlines()
    text[151] = text[151].replace(text[151].split(",")[0], "u_nobody", 1)
    bad_file.write_text("\n".join(text) + "\n")
    from recscale.serving import runtime

    mine = tmp_path / "s.txt.tmp"  # a user's file named as the scorer's temporary once was
    mine.write_text("keep me\n")
    code = runtime.main(
        [str(out), str(bad_file), "--batch-size", "100", "--out", str(tmp_path / "s.txt")]
    )
    assert code == 2 and not (tmp_path / "s.txt").exists()
    assert mine.read_text() == "keep me\n" and not list(tmp_path.glob(".s.txt.*"))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {bad_file}: line 152: column 'user_id': key not in side "), err

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [
            sys.executable,
            str(out / "recscale_model.py"),
            str(out),
            str(shop / "later.csv"),
            "--batch-size",
            "100",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=True,
    )
    np.testing.assert_allclose(np.array(res.stdout.split(), float), got, rtol=1e-7, atol=1e-9)
    assert (
        json.loads(res.stderr.strip().splitlines()[-1])["unseen_values"] == counts["unseen_values"]
    )


def test_a_criteo_run_scores_raw_lines(tmp_path):
    """A Criteo-reader run exports the reader's hashing (no vocabulary to store): its artifact
    loads and scores raw TSV lines as the checkpoint scores the reader's rows."""
    from data.config import CriteoConfig
    from recscale.serving import runtime
    from tests.data.conftest import criteo_lines

    path = tmp_path / "day.tsv"
    path.write_text("".join(line + "\n" for line in criteo_lines(300, seed=5)))
    cfg = get_preset("dlrm/tiny")
    data = dataclasses.replace(
        cfg.data,
        kind="criteo",
        train_path=str(path),
        eval_path=str(path),
        batch_size=64,
        eval_batch_size=512,
        criteo=CriteoConfig(vocab_sizes=(40,) * 26, hash_seed=3),
    )
    cfg = dataclasses.replace(
        cfg, data=data, train=dataclasses.replace(cfg.train, num_steps=2, progress=False)
    )
    wd, out = tmp_path / "run", tmp_path / "m"
    train(cfg, build_model, wd)
    export_workdir(DLRMConfig, build_model, ExportArgs(workdir=str(wd), out=str(out)))
    with restored(DLRMConfig, build_model, wd, num_devices=8) as r:
        (b,) = list(r.exp.source.eval_batches())
        want = np.asarray(
            jax.nn.sigmoid(r.exp._eval_step(r.params, r.batch_stats, r.exp.device_batch(b)))
        )[:300]
    mine = tmp_path / "s.txt.tmp"  # a user's file: the scorer writes beside it, not over it
    mine.write_text("keep me\n")
    assert runtime.main([str(out), str(path), "--out", str(tmp_path / "s.txt")]) == 0
    np.testing.assert_allclose(np.loadtxt(tmp_path / "s.txt"), want, rtol=1e-6, atol=1e-7)
    assert mine.read_text() == "keep me\n" and not list(tmp_path.glob(".s.txt.*"))


def test_warmup_compiles_every_padded_batch_size(artifact):
    model = Model.load(artifact)
    assert model.warmup(5) == [1, 2, 4, 8]
    compiled = model._call._cache_size()
    assert compiled == 4
    ids = np.full((3, 4, 3), -1, np.int32)
    model.predict(np.zeros((3, 4), np.float32), ids)  # padded to 4: nothing new to compile
    model.predict(np.zeros((8, 4), np.float32), np.full((8, 4, 3), -1, np.int32))
    assert model._call._cache_size() == compiled


def test_the_serve_command_warms_up_and_answers(artifact):
    """``python -m recscale.serve``: compiles every padded batch size before it listens, then
    answers on localhost; a bad artifact path is a one-line error."""
    import time as time_lib
    import urllib.request

    import portpicker

    port = portpicker.pick_unused_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recscale.serve",
            str(artifact),
            "--port",
            str(port),
            "--max-batch",
            "4",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()  # written once warm, just before it listens
        assert line.startswith("compiled batch sizes 1-4 in "), line
        body = json.dumps({"dense": [[0.0] * 4], "ids": [[[1], [2], [3], [4]]]}).encode()
        for _ in range(100):  # until the socket is bound
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/predict", body) as r:
                    scores = json.loads(r.read())["scores"]
                break
            except OSError:
                time_lib.sleep(0.1)
        assert len(scores) == 1 and 0.0 < scores[0] < 1.0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.close()
    from recscale.serve import main as serve_main

    with pytest.raises(SystemExit, match=r"^error: .*nope/manifest.json: not found"):
        serve_main([str(artifact.parent / "nope")])
