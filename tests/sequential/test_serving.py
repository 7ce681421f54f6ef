"""Serving the sequential families: ``python -m recscale.export`` of a 3-step sasrec/tiny and
hstu/tiny run writes a next-item artifact whose top-K is the in-process model's ranking (as
``sequential.metrics.rank_full`` ranks) and whose candidate scores are its logits;
``python -m recscale.serve`` answers the same over HTTP, batching requests, and refuses bad
requests with one line naming the field and the id; the artifact loads without recscale."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recscale import export, families
from recscale.config import get_preset
from recscale.serving.next_item import NextItemModel
from recscale.serving.runtime import ArtifactError, Model
from recscale.train.evaluation import restored
from recscale.train.loop import train
from sequential import serving
from sequential.metrics import HIGHEST, rank_full

STEPS = 3
FAMILIES = {name: families.load(name) for name in ("hstu", "sasrec")}  # registers the presets


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name) -> (family, config, workdir, artifact)``: a ``STEPS``-step tiny run on one
    device exported by ``python -m recscale.export`` (made once per family, on first use)."""
    made = {}

    def get(name: str):
        if name not in made:
            family, _, engine = name.partition("-")  # "sasrec-engine": the table in the engine
            fam = FAMILIES[family]
            cfg = get_preset(f"{family}/tiny")
            if engine:
                cfg = dataclasses.replace(
                    cfg, embeddings=dataclasses.replace(cfg.embeddings, sharding="row_wise")
                )
            cfg = dataclasses.replace(
                cfg,
                mesh=dataclasses.replace(cfg.mesh, data_parallel=1),
                data=dataclasses.replace(cfg.data, batch_size=1, eval_batch_size=1),
                train=dataclasses.replace(
                    cfg.train, num_steps=STEPS, progress=False, eval_max_batches=1
                ),
            )
            root = tmp_path_factory.mktemp(name)
            train(cfg, fam.build_model, root / "run", argv=["-m", fam.module("train")])
            man = export.main(["--workdir", str(root / "run"), "--out", str(root / "model")])
            assert man["task"] == "next_item" and man["source"]["step"] == STEPS
            made[name] = fam, cfg, root / "run", root / "model"
        return made[name]

    return get


def _histories(n_items: int, n: int) -> list[list[int]]:
    """Short, long, one cut (longer than ``n``) and one repeating its items."""
    rng = np.random.default_rng(0)
    lengths = [1, 4, n, n + 7, 9]
    out = [rng.integers(1, n_items + 1, size).tolist() for size in lengths]
    out[-1] = out[-1][:3] * 3
    return out


def _reference(fam, cfg, workdir, histories):
    """``(logits [B, V + 1], user [B, D], table [V + 1, D], history [B, N])`` of
    the checkpoint's model in process, the histories cut to their last N and packed as the
    trainer packs them (one jagged batch, tail padding)."""
    n, lcfg = cfg.model.max_seq_len, cfg.loss
    cut = [h[-n:] for h in histories]
    offsets = np.cumsum([0] + [len(h) for h in cut]).astype(np.int32)
    values = np.pad(np.concatenate(cut), (0, 16)).astype(np.int32)
    with restored(fam.config_cls, fam.build_model, workdir, num_devices=1) as r:

        @jax.jit
        def forward(params, batch_stats):
            model = nnx.merge(r.exp.graphdef, params, batch_stats)
            return model(values, offsets)[offsets[1:] - 1], model.item_table()

        user, table = forward(r.params, r.batch_stats)
    normed = table / jnp.maximum(jnp.linalg.norm(table, axis=-1, keepdims=True), lcfg.l2_eps)
    rank_s = jnp.einsum("bd,vd->bv", user, normed if lcfg.l2_norm else table, precision=HIGHEST)
    scale = 1.0 / lcfg.temperature
    if lcfg.l2_norm:
        scale = scale / jnp.maximum(jnp.linalg.norm(user, axis=-1, keepdims=True), lcfg.l2_eps)
    history = np.zeros((len(cut), n), np.int32)
    for b, h in enumerate(cut):
        history[b, : len(h)] = h
    return np.asarray(rank_s * scale), user, table, history


def _ranked(scores: np.ndarray, history: np.ndarray | None, k: int) -> np.ndarray:
    """Each row's k best item ids ``1..V`` by score, ties to the lower id, history left out."""
    s = scores.astype(np.float64).copy()
    s[:, 0] = -np.inf
    if history is not None:
        for b, h in enumerate(history):
            s[b, h[h > 0]] = -np.inf
    ids = np.arange(s.shape[1])
    return np.stack([np.lexsort((ids, -row))[:k] for row in s])


@pytest.mark.parametrize("name", ["sasrec", "hstu", "sasrec-engine"])
def test_the_exported_top_k_is_the_models_ranking(runs, name):
    """The exported top-K ranks as the checkpoint's model does in process; ``sasrec-engine``
    trained its item table in the sharded engine, exported as one table
    (``sequential.serving.per_table``)."""
    fam, cfg, workdir, art = runs(name)
    model = NextItemModel.load(art)
    n, v = cfg.model.max_seq_len, cfg.model.n_items
    assert (model.n_items, model.max_seq_len, model.max_k) == (v, n, min(100, v))
    histories = _histories(v, n)
    logits, user, table, history = _reference(fam, cfg, workdir, histories)
    k = 10
    ids, scores = model.top_k(histories, k=k)
    assert ids.shape == scores.shape == (5, k) and ids.dtype == np.int32
    assert model.counters["truncated_events"] == 7  # the history of n + 7 events
    np.testing.assert_array_equal(ids, _ranked(logits, history, k))
    got = np.take_along_axis(logits, ids, axis=1)
    print(
        f"{name}: largest relative score difference {np.max(np.abs(scores - got) / np.abs(got)):.3g}"
    )
    # A logit's rounding is float32's at the similarity's scale, 1 / temperature, not at its own
    # (a small logit is a difference of larger products): measured 1.4e-7 relative (sasrec: the
    # user embedding of another packing) and 2.2e-7 absolute at 1 / temperature = 20 (hstu).
    tol = {"rtol": 1e-6, "atol": 1e-7 / cfg.loss.temperature}
    np.testing.assert_allclose(scores, got, **tol)
    assert not np.isin(ids[-1], histories[-1]).any()  # the history's items left out
    # the ranks sequential.metrics gives these items (with the history excluded): 1..k
    b = len(histories)
    ranks = jax.jit(rank_full, static_argnames="l2_norm")(
        jnp.repeat(user, k, axis=0),
        table,
        jnp.asarray(ids.reshape(-1)),
        jnp.repeat(jnp.asarray(history), k, axis=0),
        l2_norm=cfg.loss.l2_norm,
    )
    np.testing.assert_array_equal(
        np.asarray(ranks).reshape(b, k), np.tile(np.arange(1, k + 1), (b, 1))
    )
    # without exclusion the history's items compete (the repeated one's are near the top)
    all_ids, _ = model.top_k(histories, k=k, exclude_history=False)
    np.testing.assert_array_equal(all_ids, _ranked(logits, None, k))
    # candidate scores are the logits, -inf past a shorter list
    cands = [[3, 1, v], histories[1], [7], [v, 1], histories[-1][:2]]
    got = model.score(histories, cands)
    assert got.shape == (5, 4)
    for i, c in enumerate(cands):
        np.testing.assert_allclose(got[i, : len(c)], logits[i, c], **tol)
        assert np.isneginf(got[i, len(c) :]).all()


def test_the_top_k_over_chunks_of_the_item_table_is_exact(runs, monkeypatch, tmp_path):
    """13 chunks of 16 item rows (the last one padded), each merged into the running top-K,
    give the one-chunk program's items and scores, history items excluded in every chunk."""
    _, cfg, workdir, art = runs("sasrec")
    histories = _histories(cfg.model.n_items, cfg.model.max_seq_len)
    monkeypatch.setattr(serving, "CHUNK", 16)
    export.main(["--workdir", str(workdir), "--out", str(tmp_path / "chunked")])
    whole, chunked = NextItemModel.load(art), NextItemModel.load(tmp_path / "chunked")
    for exclude in (True, False):
        ids, scores = whole.top_k(histories, k=30, exclude_history=exclude)
        got_ids, got_scores = chunked.top_k(histories, k=30, exclude_history=exclude)
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_allclose(got_scores, scores, rtol=1e-6)


def _serve(app, requests):
    from aiohttp.test_utils import TestClient, TestServer

    async def main():
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            return await requests(client)

    return asyncio.run(main())


def test_the_serve_command_answers_history_requests_in_batches(runs, monkeypatch):
    import gc

    from aiohttp import web

    from recscale.serve import main as serve_main
    from recscale.serving.server import BATCHER, MODEL

    fam, cfg, _, art = runs("sasrec")
    served = []
    monkeypatch.setattr(web, "run_app", lambda app, **kw: served.append(app))
    monkeypatch.setattr(gc, "freeze", lambda: None)  # the test process stays collectable
    serve_main([str(art), "--max-batch", "2", "--max-wait-ms", "50"])
    (app,) = served
    model = app[MODEL]
    assert isinstance(model, NextItemModel) and model._top_k._cache_size() == 2  # 1, 2
    histories = _histories(cfg.model.n_items, cfg.model.max_seq_len)
    want_ids, want_scores = model.top_k(histories, k=7)
    cands = [[5, 9, 2]] * len(histories)
    want_cands = model.score(histories, cands)

    async def requests(client):
        async def one(body):
            r = await client.post("/predict", json=body)
            assert r.status == 200, await r.text()
            return await r.json()

        bodies = [{"history": h, "k": 7} for h in histories]
        bodies += [{"history": h, "candidates": [5, 9, 2]} for h in histories]
        got = await asyncio.gather(*(one(b) for b in bodies))
        return got, await (await client.get("/metrics")).json()

    got, stats = _serve(app, requests)
    # The server runs batches of 1-2 requests, the reference all 5 histories at once: XLA:CPU
    # rounds a matmul of another batch shape differently (measured up to 1.3e-6 relative once
    # the engine's merge changed the model's graph), so scores agree to float32 rounding, not
    # to the bit; the ids must be equal.
    for i in range(len(histories)):
        assert got[i]["items"] == want_ids[i].tolist()
        np.testing.assert_allclose(got[i]["scores"], want_scores[i], rtol=1e-5)
        np.testing.assert_allclose(got[5 + i]["scores"], want_cands[i], rtol=1e-5)
    assert [g["truncated_events"] for g in got[:5]] == [0, 0, 0, 7, 0]
    assert stats["truncated_events"] == 14 and stats["malformed"] == 0
    # ten requests of two programs, batched per program within --max-batch 2
    assert stats["requests"] == 10 and 5 <= stats["batches"] < 10, stats
    assert app[BATCHER].max_batch == 2


def test_bad_requests_get_one_line_errors_naming_the_field(runs):
    from recscale.serving.server import make_app

    _, cfg, _, art = runs("sasrec")
    v, n = cfg.model.n_items, cfg.model.max_seq_len
    model = NextItemModel.load(art, max_candidates=8)
    cases = [
        ({"history": [1, 2, v + 1]}, f"history[2]: item id {v + 1} is out of range 1..{v}"),
        ({"history": [0]}, f"history[0]: item id 0 is out of range 1..{v}"),
        ({"history": [1, -3]}, "history[1]: item id -3 is out of range"),
        ({"history": [2**70]}, "history[0]: item id 1180591620717411303424 is out of range"),
        ({"history": [1, "2"]}, "history[1]: item ids are integers, got str '2'"),
        ({"history": [1, 2.0]}, "history[1]: item ids are integers, got float 2.0"),
        ({"history": [True]}, "history[0]: item ids are integers, got bool True"),
        ({"history": "1 2 3"}, "history: expected a list of item ids, got str"),
        ({"history": []}, "history: is empty"),
        ({"k": 3}, "history: missing"),
        ({"history": [1], "k": 101}, "k: 101 is out of range 1..100"),
        ({"history": [1], "k": 0}, "k: 0 is out of range 1..100"),
        ({"history": [1], "k": "5"}, "k: expected an integer, got str '5'"),
        ({"history": [1], "exclude_history": "yes"}, "exclude_history: expected true or false"),
        ({"history": [1], "candidates": [4, v + 9]}, f"candidates[1]: item id {v + 9} is out"),
        (
            {"history": [1], "candidates": list(range(1, 10))},
            "candidates: 9 item ids, expected 1..8",
        ),
        ({"history": [1], "candidates": [2], "k": 3}, "candidates: scored as given; k and"),
        ({"histories": [[1]]}, "unknown field 'histories' (expected history, k, exclude_history"),
        ([1, 2], "the body must be a JSON object with a history"),
        (
            b'{"history": ' + b"[" * 20 + b"]" * 20 + b"}",
            "21 objects and arrays, more than a history",
        ),
    ]

    async def requests(client):
        out = []
        for body, _ in cases:
            kw = {"data": body} if isinstance(body, bytes) else {"json": body}
            r = await client.post("/predict", **kw)
            out.append((r.status, await r.json()))
        long = await client.post("/predict", json={"history": list(range(1, n + 41))})
        big = await client.post("/predict", json={"history": [1] * 2000})
        stats = await (await client.get("/metrics")).json()
        return out, (long.status, await long.json()), big.status, stats

    app = make_app(model, max_body=4000)
    out, (long_status, long), big, stats = _serve(app, requests)
    for (status, body), (_, want) in zip(out, cases, strict=True):
        msg = body.get("error", "")
        assert status == 400 and want in msg and "\n" not in msg, (want, status, body)
    # longer than max_seq_len: cut to the most recent events, counted; a body too large: 413
    assert long_status == 200 and long["truncated_events"] == 40 and len(long["items"]) == 10
    assert not set(long["items"]) & set(range(41, n + 41))  # the kept events, excluded
    assert big == 413
    assert stats["malformed"] == len(cases) + 1 and stats["truncated_events"] == 40


def test_the_artifact_is_checked_and_loads_without_recscale(runs, tmp_path, capsys):
    _, cfg, workdir, art = runs("sasrec")
    with pytest.raises(ArtifactError, match=r"task 'next_item'; this loader reads ctr models"):
        Model.load(art)
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    man = json.loads((bad / "manifest.json").read_text())
    name = next(iter(man["weights"]))
    man["weights"][name]["shape"] = [1, 2]
    (bad / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match=f"weight {name!r} has shape"):
        NextItemModel.load(bad)
    del man["task"]  # a manifest without a task is a CTR model's
    (bad / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match="task 'ctr'; this loader reads next_item models"):
        NextItemModel.load(bad)
    # the item table is served in float32: a quantized export is refused in one line
    with pytest.raises(SystemExit, match=r"^error: --precision int8 .* exported in float32"):
        export.main(
            ["--workdir", str(workdir), "--out", str(tmp_path / "q"), "--precision", "int8"]
        )
    # a fresh interpreter with the artifact's own loader: no recscale, flax or sequential
    histories = _histories(cfg.model.n_items, cfg.model.max_seq_len)
    want, _ = NextItemModel.load(art).top_k(histories, k=5)
    code = textwrap.dedent(f"""
        import sys, json
        sys.path.insert(0, {str(art)!r})
        from recscale_next_item import NextItemModel
        ids, _ = NextItemModel.load({str(art)!r}).top_k({histories!r}, k=5)
        mods = {{k.split(".")[0] for k in sys.modules}} & {{"recscale", "flax", "sequential"}}
        print(json.dumps([ids.tolist(), sorted(mods)]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-2000:]
    ids, mods = json.loads(res.stdout.strip().splitlines()[-1])
    assert ids == want.tolist() and mods == []
