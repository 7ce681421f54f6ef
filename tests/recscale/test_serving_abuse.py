"""The server under hostile clients (issue 35): an attacker's requests against a live server on
127.0.0.1 (bodies too large, too slow, too many, malformed in every way; unique values without
end), a malformed manifest against ``serve``. The artifact is built by hand (a feature spec
prepared, a one-line forward exported), so no model is trained here."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import shutil
import threading
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recscale.serving import rows as rows_lib
from recscale.serving.export import manifest_inputs
from recscale.serving.runtime import FORMAT, Model


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """An artifact taking raw rows (a string vocabulary, a hash, a bag, a side table's column
    and a number) whose forward is a sigmoid of the dense value and the bag sizes."""
    from data.tabular import prepare
    from data.tabular.spec import spec_from_dict

    d = tmp_path_factory.mktemp("abuse")
    cities = ["paris", "rome", "oslo"]
    (d / "train.csv").write_text(
        "label,uid,city,item,tags,price\n"
        + "".join(
            f"{i % 2},u{i % 5},{cities[i % 3]},it{i},{'a|b' if i % 2 else 'c'},{i * 1.5}\n"
            for i in range(40)
        )
    )
    (d / "users.csv").write_text(
        "uid,gender\n" + "".join(f"u{i},{'fm'[i % 2]}\n" for i in range(5))
    )
    spec = spec_from_dict(
        {
            "name": "abuse",
            "train": ["train.csv"],
            "split": {"kind": "random", "valid_fraction": 0.2, "seed": 0},
            "label": {"column": "label"},
            "joins": [{"path": ["users.csv"], "key": "uid", "columns": ["gender"]}],
            "features": [
                {"name": "city", "kind": "categorical"},
                {"name": "item", "kind": "categorical", "hash_buckets": 50},
                {"name": "tags", "kind": "multi_categorical", "separator": "|", "max_hotness": 3},
                {"name": "gender", "kind": "categorical"},
                {"name": "price", "kind": "numeric", "standardize": True},
            ],
        },
        where="test",
        base_dir=str(d),
    )
    p = prepare(spec, str(d / "prep"), workers=1, progress=False)
    desc, arrays = p.serving_encoding()
    schema = p.schema
    weights = {"dense": np.full((schema.num_dense,), 0.5, np.float32), "bag": np.float32(0.1)}

    def forward(w, dense, ids):
        return jax.nn.sigmoid(dense @ w["dense"] + w["bag"] * (ids >= 0).sum((1, 2)))

    (b,) = jax.export.symbolic_shape("b")
    exported = jax.export.export(jax.jit(forward), platforms=("cpu",))(
        {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in weights.items()},
        jax.ShapeDtypeStruct((b, schema.num_dense), jnp.float32),
        jax.ShapeDtypeStruct((b, schema.num_sparse, schema.max_hotness), jnp.int32),
    )
    out = d / "m"
    out.mkdir()
    (out / "forward.jax").write_bytes(bytes(exported.serialize()))
    np.savez(out / "weights.npz", **weights)
    np.savez(out / "vocab.npz", **arrays)
    manifest = {
        "format": FORMAT,
        "inputs": manifest_inputs(schema),
        "weights": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in weights.items()},
        "vocab": desc,
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def _serve(model, requests, **kw):
    """Runs ``requests(client) -> result`` against the app on a real 127.0.0.1 socket."""
    from aiohttp.test_utils import TestClient, TestServer

    from recscale.serving.server import make_app

    async def main():
        async with TestClient(TestServer(make_app(model, **kw), host="127.0.0.1")) as client:
            return await requests(client)

    return asyncio.run(main())


async def _raw(client, head: bytes, body: bytes = b"", wait: float = 10.0) -> bytes:
    """Sends ``head`` and ``body`` on a socket of its own and returns the answer (its head and
    body), then that the server closed the connection (within ``wait`` seconds)."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(wait):
            answer = await reader.readuntil(b"\r\n\r\n")
            size = int(answer.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            answer += await reader.readexactly(size)
            await reader.read()  # until the server closes the connection
        return answer
    finally:
        writer.close()
        await writer.wait_closed()


def _head(length: int | None, ctype: str = "application/json") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    chunked = "" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (
        f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n{size}{chunked}\r\n"
    ).encode()


ROW = {"uid": "u1", "city": "paris", "item": "it3", "tags": "a|b", "price": "2.5"}


def test_unknown_values_are_never_remembered_and_the_cache_keeps_its_bytes(art):
    """Unique values cost the encoder no memory it keeps: an unseen vocabulary value (a city
    never seen), a long one, or (beyond ``cache_bytes``) a hashed one or a number."""
    budget = 64 << 10
    model = Model.load(art, cache_bytes=budget)
    enc = model.rows
    unseen = [f"city{i}-" + "x" * 40 for i in range(20)]

    async def requests(client):
        out = []
        for i, city in enumerate(unseen):
            long = "y" * 5000 + str(i)  # past MAX_CACHED_CHARS
            rows = [{**ROW, "city": city}, {**ROW, "item": long, "tags": f"a|{long}"}]
            r = await client.post("/predict", json={"examples": rows})
            out.append((r.status, await r.json()))
        return out

    out = _serve(model, requests)
    assert all(s == 200 for s, _ in out), out[0]
    assert all(b["unseen_values"] == 2 for _, b in out)  # the city; the long tag
    cached = set().union(*(c.keys() for c in enc._caches.values()))
    assert "paris" in cached and "a|b" in cached  # known values are remembered
    assert not cached & set(unseen)
    assert max(map(len, cached)) <= rows_lib.MAX_CACHED_CHARS
    # a flood of unique hashed values and numbers: what stays is within the budget
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(100):
            model.encode(
                [
                    {**ROW, "item": f"item-{k}-{i}-" + "z" * 150, "price": f"{k}.{i:06d}1"}
                    for i in range(64)
                ]
            )
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert enc.cached_bytes <= budget
    assert kept <= budget + (32 << 10), kept  # 6,400 unique values would keep ~2.5 MB
    assert 0 < enc.remembered() < 6400


def test_bodies_are_bounded_and_counted_before_they_are_parsed(art, monkeypatch):
    model = Model.load(art)
    encoded = []
    monkeypatch.setattr(
        model, "encode", lambda rows: encoded.append(1) or Model.encode(model, rows)
    )

    async def requests(client):
        too_long = await _raw(client, _head(10_000_000), b"{}")  # refused before reading
        chunks = b"".join(b"%x\r\n%s\r\n" % (4096, b" " * 4096) for _ in range(40))
        chunked = await _raw(client, _head(None), chunks + b"0\r\n\r\n")
        many = await client.post("/predict", json={"examples": [ROW] * 9})
        nested = await client.post("/predict", data=b'{"examples": ' + b"[" * 2000)
        ok = await client.post("/predict", json={"examples": [ROW] * 8})
        return too_long, chunked, (many.status, await many.json()), await nested.json(), ok.status

    too_long, chunked, many, nested, ok = _serve(model, requests, max_batch=8, max_body=100_000)
    assert too_long.startswith(b"HTTP/1.1 413") and b"10000000 bytes, at most 100000" in too_long
    assert chunked.startswith(b"HTTP/1.1 413") and b"over 100000 bytes" in chunked
    assert many == (400, {"error": "a request of 9 examples exceeds max_batch=8"})
    assert "2001 objects and arrays, more than 8 examples" in nested["error"]
    assert ok == 200 and encoded == [1]  # only the request within max_batch was encoded


def test_a_slow_body_is_closed_with_408_and_the_server_answers_meanwhile(art):
    model = Model.load(art)

    async def requests(client):
        slow = asyncio.create_task(_raw(client, _head(5000), b'{"examples": [', wait=10))
        await asyncio.sleep(0.1)
        health = await client.get("/healthz")
        ok = await client.post("/predict", json={"examples": [ROW]})
        return await slow, health.status, ok.status

    slow, health, ok = _serve(model, requests, body_timeout=0.5)
    assert slow.startswith(b"HTTP/1.1 408") and b"over 0.5 s to arrive (14 bytes read)" in slow
    assert b"Connection: close" in slow
    assert health == ok == 200


def test_a_slow_or_idle_head_is_closed(art):
    model = Model.load(art)

    async def requests(client):
        out = []
        for head in (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-", b""):
            reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
            try:
                writer.write(head)
                await writer.drain()
                out.append(await asyncio.wait_for(reader.read(), 10))
            finally:
                writer.close()
                await writer.wait_closed()
        return out

    assert _serve(model, requests, idle_timeout=0.5) == [b"", b""]  # closed, nothing sent


def test_a_request_head_over_its_bound_is_refused_and_the_server_answers_meanwhile(art, caplog):
    """A head is bounded in its request line, its fields' values and their number (aiohttp's
    defaults let one connection hold 128 fields of 8 KiB names and values, 4 MiB of memory, for
    15 s): past any bound it is refused with 400 or 431 and its connection closed, while the
    server answers others; a head at the bounds passes. Refused heads are counted
    (``malformed_heads``), not logged with a traceback each (aiohttp logs them at ERROR)."""
    from recscale.serving.server import MAX_FIELD, MAX_FIELDS, MAX_LINE

    model = Model.load(art)
    body = json.dumps({"examples": [ROW]}).encode()

    def head(path: str = "/predict", fields: int = 0, value: int = 1) -> bytes:
        """The head of ``body``: its 4 fields, and ``fields`` more with values of ``value``
        bytes."""
        extra = "".join(f"X-{i:03d}: {'v' * value}\r\n" for i in range(fields))
        return (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
        ).encode()

    async def requests(client):
        out = []
        for h in (
            head(fields=MAX_FIELDS - 3),  # one field too many
            head(fields=1, value=MAX_FIELD + 1),  # one value too long
            head(path="/predict?" + "q" * MAX_LINE),  # the request line too long
        ):
            out.append(await _raw(client, h, body))
            out.append((await client.get("/healthz")).status)
        # at the bounds: as many fields as a head may have, each as long as it may be (its line
        # a few bytes under MAX_FIELD: aiohttp's pure-Python parser counts the whole line)
        out.append(await _raw(client, head(fields=MAX_FIELDS - 4, value=MAX_FIELD - 8), body))
        out.append((await (await client.get("/metrics")).json())["malformed_heads"])
        return out

    with caplog.at_level(logging.DEBUG):
        out = _serve(model, requests)
    for refused in out[0:6:2]:
        assert refused.split(b" ")[1] in (b"400", b"431"), refused[:200]
    assert out[1:6:2] == [200, 200, 200]
    assert out[6].startswith(b"HTTP/1.1 200"), out[6][:200]
    assert out[7] == 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text[:500]


def test_bodies_in_flight_are_bounded_in_bytes(art):
    """A connection holding most of a large body: past ``max_inflight`` bytes in all (a body's
    first 64 KiB not counted), a new large request gets 503 at once instead of its body being
    held too; a small one is still answered."""
    model = Model.load(art)

    async def requests(client):
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        try:
            writer.write(_head(200_000) + b" " * 180_000)
            await writer.drain()
            for _ in range(500):  # until the server has read them
                held = (await (await client.get("/metrics")).json())["inflight_bytes"]
                if held >= 180_000 - (64 << 10):
                    break
                await asyncio.sleep(0.01)
            body = b" " * 170_000 + json.dumps({"examples": [ROW]}).encode()
            r = await client.post("/predict", data=body)
            small = await client.post("/predict", json={"examples": [ROW]})
            return held, r.status, await r.json(), small.status
        finally:
            writer.close()
            await writer.wait_closed()

    held, status, body, small = _serve(model, requests, max_body=200_000, max_inflight=200_000)
    assert held == 180_000 - (64 << 10)
    assert status == 503 and "bytes of bodies in flight (max 200000)" in body["error"], body
    assert small == 200  # a small request is not shut out


def test_encoding_runs_off_the_event_loop(art, monkeypatch):
    """While a body is being encoded, the server answers ``/healthz``: the encoding blocks a
    thread, not the event loop (the encoder here waits until the health check has answered)."""
    model = Model.load(art)
    answered, threads = threading.Event(), []

    def encode(rows):
        threads.append(threading.current_thread().name)
        assert answered.wait(10), "/healthz was not answered while encoding"
        return Model.encode(model, rows)

    monkeypatch.setattr(model, "encode", encode)

    async def requests(client):
        pending = asyncio.create_task(client.post("/predict", json={"examples": [ROW]}))
        while not threads:
            await asyncio.sleep(0.01)
        health = await asyncio.wait_for(client.get("/healthz"), 5)
        answered.set()
        r = await pending
        return health.status, r.status

    assert _serve(model, requests) == (200, 200)
    assert threads[0].startswith("encode")


def test_malformed_bodies_get_one_line_400s_without_paths_or_long_echoes(art, caplog):
    model = Model.load(art)
    big = "v" * 1_000_000
    bodies = [
        (b'{"examples": [' + b"[" * 3000 + b"]" * 3000 + b"]}", "nested too deeply"),
        (b'{"examples": [{"price": ' + b"9" * 5000 + b"}]}", "4300"),
        (b'{"dense": [[' + b"1" * 5000 + b']], "ids": []}', "4300"),
        (json.dumps({"examples": [ROW]}).encode("utf-16"), "not UTF-8"),
        (b'{"examples": [{"uid": "\xff\xfe"}]}', "not UTF-8: byte 23"),
        (b"{not json", "the body is not JSON: Expecting property name"),
        ({"examples": [{**ROW, "price": big}]}, "column 'price': not a number: 'vvv"),
        ({"examples": [{**ROW, "uid": big}]}, "key not in side table users.csv: 'vvv"),
        ({"examples": [{**ROW, "gender": "f"}]}, "comes from side table users.csv (send"),
        ({"examples": [{**ROW, big: 1}]}, "unknown column 'vvv"),
        ({"examples": [{**ROW, "tags": [[[[[[["a"]]]]]]]}]}, "column 'tags': token expected a"),
        ({big: 1}, "unknown fields ['vvv"),
        ({"dense": [[1e400]], "ids": [[[0]] * 4]}, "not finite"),
    ]

    async def requests(client):
        out = []
        for body, _ in bodies:
            kw = {"data": body} if isinstance(body, bytes) else {"json": body}
            r = await client.post("/predict", **kw)
            out.append((r.status, await r.text()))
        for charset in ("foo", "latin-1"):
            r = await client.post(
                "/predict",
                data=json.dumps({"examples": [ROW]}).encode(),
                headers={"Content-Type": f"application/json; charset={charset}"},
            )
            out.append((r.status, await r.text()))
        return out

    with caplog.at_level("DEBUG"):
        out = _serve(model, requests)
    wants = [w for _, w in bodies] + ["charset 'foo': send UTF-8", "charset 'latin-1'"]
    for (status, text), want in zip(out, wants, strict=True):
        assert status == 400, (want, status, text[:300])
        msg = json.loads(text)["error"]
        assert want in msg, (want, msg)
        assert len(text) < 400 and "\n" not in msg
        assert str(art.parent) not in msg  # no path of the machine the model was made on
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_serve_names_the_file_and_key_of_a_malformed_manifest(art, tmp_path, monkeypatch):
    from aiohttp import web

    from recscale.serve import main as serve_main

    # a manifest that loads is served: fail here instead of serving until killed
    monkeypatch.setattr(web, "run_app", lambda *a, **kw: pytest.fail("a malformed manifest loaded"))

    def broken(edit):
        out = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(art, out)
        man = json.loads((out / "manifest.json").read_text())
        edit(man)
        (out / "manifest.json").write_text(json.dumps(man))
        return str(out)

    cases = [
        (lambda m: m["weights"]["bag"].pop("dtype"), "malformed weights.bag: key 'dtype'"),
        (lambda m: m["inputs"]["features"][1].pop("vocab_size"), "inputs: key 'vocab_size'"),
        (lambda m: m["vocab"].pop("sparse"), "malformed vocab: key 'sparse' is missing"),
        (lambda m: m["vocab"]["tables"].update(city="int64"), "vocab.npz: array 'vocab.city'"),
        # a feature's keys are checked at load, not at every request (each a 500 KeyError)
        (lambda m: m["vocab"]["sparse"][0].pop("kind"), "vocab.sparse.city: key 'kind' is missing"),
        (lambda m: m["vocab"]["dense"][0].pop("clip"), "vocab.dense.price: key 'clip' is missing"),
        (lambda m: m["vocab"]["sparse"][2].pop("name"), "vocab.sparse[2]: key 'name' is missing"),
        (lambda m: m["vocab"]["joins"][0].pop("file"), "vocab.joins[0]: key 'file' is missing"),
        (
            lambda m: m["vocab"]["sparse"].append("x"),
            "vocab.sparse[4]: TypeError: an object expected, got str",
        ),
    ]
    for edit, want in cases:
        path = broken(edit)
        with pytest.raises(SystemExit) as e:
            serve_main([path])
        msg = str(e.value)
        assert msg.startswith("error: ") and want in msg and "\n" not in msg, msg
        assert path in msg  # the file is named


def test_serve_flags_reach_the_app_and_the_model(art, monkeypatch):
    """``python -m recscale.serve``'s bounds reach the server and the row encoder: given, and by
    default (``max_body`` = ``max_batch`` x 8 KiB + 64 KiB, ``max_inflight`` 16 of them, a
    64 MiB cache)."""
    import gc as gc_lib

    from aiohttp import web

    from recscale.serve import main as serve_main
    from recscale.serving.server import BATCHER, LIMITS, MODEL

    served = []
    monkeypatch.setattr(web, "run_app", lambda app, **kw: served.append((app, kw)))
    monkeypatch.setattr(gc_lib, "freeze", lambda: None)  # the test process stays collectable
    flags = ["--max-body", "123456", "--body-timeout-s", "2.5", "--max-inflight", "999999"]
    flags += ["--cache-mb", "3", "--max-queue", "64", "--max-wait-ms", "7", "--workers", "2"]
    serve_main([str(art), "--max-batch", "4", "--port", "8123", *flags])
    serve_main([str(art), "--max-batch", "8"])
    (given, kw), (default, _) = served
    assert kw == {"host": "127.0.0.1", "port": 8123, "print": None}
    lim, batcher = given[LIMITS], given[BATCHER]
    want = (4, 123456, 2.5, 999999)
    assert (lim.max_batch, lim.max_body, lim.body_timeout, lim.max_inflight) == want
    want = (4, 64, 0.007, 2)
    assert (batcher.max_batch, batcher.max_queue, batcher.max_wait, batcher.workers) == want
    assert given[MODEL].rows.cache_bytes == 3 << 20
    lim = default[LIMITS]
    assert lim.max_body == 8 * (8 << 10) + (64 << 10) and lim.max_inflight == 16 * lim.max_body
    assert (lim.body_timeout, default[BATCHER].max_queue) == (5.0, 4096)
    assert default[MODEL].rows.cache_bytes == 64 << 20


def test_the_memory_bound_is_the_readmes_arithmetic():
    """``memory_bound`` (which ``benchmarks/serving_abuse.py`` prints beside its peaks) gives the
    README's and BENCHMARKS.md's figures: 40.9 MiB at the benchmark's flags for Frappe's 10
    one-id features (the queue's 0.16 MiB included), about 155 MiB at the defaults."""
    from recscale.serving.server import body_bounds, memory_bound

    def bound(max_batch: int, cache_mb: int, values: int) -> float:
        max_body, max_inflight = body_bounds(max_batch)
        return (
            memory_bound(
                max_batch=max_batch,
                max_body=max_body,
                max_inflight=max_inflight,
                cache_bytes=cache_mb << 20,
                max_queue=4096,
                workers=1,
                example_values=values,
            )
            / 2**20
        )

    assert body_bounds(64) == (576 << 10, 9 << 20)
    assert bound(64, 16, 10) == 9 + 15.75 + 16 + (4096 + 192) * 10 * 4 / 2**20
    assert round(bound(64, 16, 10), 1) == 40.9
    assert round(bound(256, 64, 10)) == round(bound(256, 64, 39)) == 155
