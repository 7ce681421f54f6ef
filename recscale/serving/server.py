"""An HTTP server of an exported model (issue 20), on aiohttp.

``python -m recscale.serve MODEL [--host 127.0.0.1] [--port 8080] [--max-batch 256]
[--max-wait-ms 2] [--max-queue 4096] [--workers 1]``

* ``POST /predict`` with ``{"examples": [...]}`` (the example format of
  ``recscale.serving.runtime.Model.encode``: raw rows, objects of column: value, where the
  artifact has its data's encoding; else ``{"dense": {...}, "features": {...}}`` of ids) or
  ``{"dense": [[...]], "ids": [[[...]]]}`` (encoded arrays); answers ``{"scores": [...],
  "unseen_values": n, "missing_features": n}`` (and ``truncated_tokens`` for raw rows).
* ``GET /healthz``: ``{"ok": true}``; ``GET /metrics``: the counters (requests, examples,
  batches, mean batch, shed, malformed requests, out-of-vocabulary ids and unseen values).

Malformed requests get ``400`` with ``{"error": "..."}`` naming the example and field; a request
the bounded queue cannot take gets ``503`` (shed, counted) at once; a body over ``max_body``
bytes gets ``413``. Requests are scored by the dynamic batcher (``recscale.serving.batcher``).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from recscale.serving.batcher import DynamicBatcher, Overloaded
from recscale.serving.runtime import ArtifactError, Model

BATCHER = web.AppKey("batcher", DynamicBatcher)
MODEL = web.AppKey("model", Model)
COUNTS = web.AppKey("counts", dict)


def _error(status: int, msg: str) -> web.Response:
    return web.json_response({"error": msg}, status=status)


async def predict(request: web.Request) -> web.Response:
    app = request.app
    model, batcher, counts = app[MODEL], app[BATCHER], app[COUNTS]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        counts["malformed"] += 1
        return _error(400, f"the body is not JSON: {e}")
    try:
        enc: dict[str, Any] = {"unseen_values": 0, "missing_features": 0}
        if not isinstance(body, dict):
            raise ArtifactError("the body must be a JSON object with examples (or dense and ids)")
        if "examples" in body:
            if set(body) != {"examples"} or not isinstance(body["examples"], list):
                raise ArtifactError('expected {"examples": [...]} and nothing else')
            if not body["examples"]:
                raise ArtifactError("examples is empty")
            dense, ids, enc = model.encode(body["examples"])
        elif set(body) == {"dense", "ids"}:
            dense, ids = body["dense"], body["ids"]  # checked (and named in errors) below
        else:
            raise ArtifactError(
                f"unknown fields {sorted(body)}: expected examples, or dense and ids"
            )
        dense, ids, oov = model.check(dense, ids)
    except (ArtifactError, ValueError) as e:
        counts["malformed"] += 1
        return _error(400, str(e))
    try:
        scores = await batcher.score(dense, ids)
    except Overloaded as e:
        return _error(503, str(e))
    except ValueError as e:  # larger than a batch
        counts["malformed"] += 1
        return _error(400, str(e))
    # counted for answered requests only (a shed request is sent again)
    for k, v in enc.items():
        counts[k] = counts.get(k, 0) + v
    counts["out_of_vocab_ids"] += oov
    return web.json_response({"scores": [float(s) for s in scores], **enc})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    return web.json_response({**app[BATCHER].stats.as_dict(), **app[COUNTS]})


def make_app(
    model: Model,
    *,
    max_batch: int = 256,
    max_wait: float = 0.002,
    max_queue: int = 4096,
    workers: int = 1,
    max_body: int = 8 << 20,
) -> web.Application:
    """The server's application (``web.run_app`` it, or ``aiohttp.test_utils`` in tests)."""
    batcher = DynamicBatcher(
        model.predict_checked,
        max_batch=max_batch,
        max_wait=max_wait,
        max_queue=max_queue,
        workers=workers,
    )
    app = web.Application(client_max_size=max_body)
    app[MODEL], app[BATCHER] = model, batcher
    app[COUNTS] = {"malformed": 0, "unseen_values": 0, "missing_features": 0, "out_of_vocab_ids": 0}
    app.router.add_post("/predict", predict)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)

    async def start(app: web.Application) -> None:
        batcher.start()

    async def stop(app: web.Application) -> None:
        await batcher.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app
