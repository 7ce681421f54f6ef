"""An HTTP server of an exported model (issue 20), on aiohttp.

``python -m recscale.serve MODEL [--host 127.0.0.1] [--port 8080] [--max-batch 256]
[--max-wait-ms 2] [--max-queue 4096] [--workers 1] [--max-body 0] [--body-timeout-s 5]
[--max-inflight 0] [--cache-mb 64]``

* ``POST /predict`` with ``{"examples": [...]}`` (the example format of
  ``recscale.serving.runtime.Model.encode``: raw rows, objects of column: value, where the
  artifact has its data's encoding; else ``{"dense": {...}, "features": {...}}`` of ids) or
  ``{"dense": [[...]], "ids": [[[...]]]}`` (encoded arrays); answers ``{"scores": [...],
  "unseen_values": n, "missing_features": n}`` (and ``truncated_tokens`` for raw rows).
* a next-item model's (``recscale.serving.next_item``, HSTU, SASRec) ``POST /predict`` takes
  one history, item ids oldest first: ``{"history": [...], "k": 10, "exclude_history": true}``
  answers its ``k`` best next items (at most ``max_k``; ``exclude_history`` true by default,
  the history's own items left out as the ranking metrics do; fewer where fewer are left),
  ``{"items": [...], "scores": [...], "truncated_events": n}``; ``{"history": [...],
  "candidates": [...]}`` answers ``{"scores": [...]}`` of the candidates in their order (at most
  ``max_candidates``). A history longer than the model's ``max_seq_len`` is cut to its most
  recent events, as training cut it, and the events cut are counted (in the answer and
  ``/metrics``); an id outside ``1..V``, a wrong type or a ``k`` out of range is a 400 naming
  the field and the id. Requests of one program are batched together.
* ``GET /healthz``: ``{"ok": true}``; ``GET /metrics``: the counters (requests, examples,
  batches, mean batch, shed, malformed requests, out-of-vocabulary ids and unseen values, or
  a next-item model's truncated events).

What a client can hold (issue 35), each refused with a one-line ``{"error": "..."}`` and the
connection closed where the body was not read whole:

* a body of at most ``max_body`` bytes (by default ``max_batch`` x ``EXAMPLE_BYTES`` + 64 KiB),
  refused with ``413`` from its ``Content-Length`` before a byte is read (a chunked one once it
  passes the bound); read within ``body_timeout`` seconds, else ``408``;
* a connection without a whole request head for ``idle_timeout`` seconds (idle, or sending its
  head slowly) is closed; a head has a request line of at most ``MAX_LINE`` bytes and at most
  ``MAX_FIELDS`` fields, each name and value at most ``MAX_FIELD`` bytes (0.34 MiB held),
  else it is refused with 400 (aiohttp's answer) and the connection closed;
* bodies being read or decoded hold at most ``max_inflight`` bytes in all beyond their first
  ``SMALL_BODY`` bytes each (by default 16 bodies of ``max_body``): a request past it gets
  ``503`` at once, as one the batcher's bounded queue cannot take
  (``recscale.serving.batcher``), while small requests still pass;
* a body is decoded (strict UTF-8, JSON), counted (at most ``max_batch`` examples, from its
  brackets before it is parsed and from its list after) and encoded in a thread
  (``ENCODERS`` of them), never on the event loop, so ``/healthz`` answers meanwhile;
* a malformed body is ``400`` naming the example and field, echoing at most about 80 characters
  of a bad value, never a server path; a failure of the server's own is ``500`` with one line.

The raw-row encoder remembers known values only, within ``cache_bytes``
(``recscale.serving.rows.RowEncoder``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from recscale.serving import next_item
from recscale.serving.batcher import DynamicBatcher, Overloaded
from recscale.serving.next_item import NextItemModel
from recscale.serving.runtime import CACHE_BYTES, MANIFEST, ArtifactError, Model, show

EXAMPLE_BYTES = 8 << 10
"""A request's bytes an example allows: ``max_body`` defaults to ``max_batch`` times this, plus
64 KiB (a raw Criteo row is about 500 bytes of JSON, an encoded example with 26 bags of 20 ids
about 4 KiB)."""
ENCODERS = 2
"""Threads that decode and encode bodies."""
SMALL_BODY = 64 << 10
"""A body's bytes its connection holds uncounted in ``max_inflight`` (aiohttp buffers about
twice this a connection anyway)."""
LINGER = 1.0
"""Seconds a connection whose body was refused stays open, its bytes dropped (aiohttp's
``lingering_time``, 10 s by default)."""
IDLE_TIMEOUT = 15.0
"""Seconds a connection may stay open without a whole request head (idle between requests,
or sending its head slowly) before it is closed (aiohttp's ``keepalive_timeout``)."""
MAX_LINE = 2048
"""The longest request line (aiohttp's ``max_line_size``, 8190 by default): the server's paths
are short and take no query."""
MAX_FIELD = 4096
"""The longest name, and the longest value, of a head's field (``max_field_size``, 8190 by
default): a bearer token or a tracing header fits."""
MAX_FIELDS = 32
"""The most fields of a head (``max_headers``, 128 by default): a client sends about 8, proxies
and a service mesh add about as many. A head is at most 2 KiB + 32 x 8 KiB (aiohttp's compiled
parser checks a name and a value each against ``MAX_FIELD``), held as about twice its bytes:
0.34 MiB a connection at these bounds, 2 MiB and more at aiohttp's defaults (tracemalloc)."""
MAX_ERROR_CHARS = 300
"""The longest error message sent (values in it are cut to ~80 characters before)."""
NEXT_ITEM_FIELDS = ("history", "k", "exclude_history", "candidates")
"""A next-item request's fields (the module's docstring)."""
NEXT_ITEM_CONTAINERS = 8
"""Most ``{`` and ``[`` of a next-item request (it needs 3: the object and two lists)."""
DEFAULT_K = 10
"""A top-K request's ``k`` where it gives none (at most the model's ``max_k``)."""

BATCHER = web.AppKey("batcher", DynamicBatcher)
MODEL = web.AppKey("model", object)  # a Model or a NextItemModel
COUNTS = web.AppKey("counts", dict)
POOL = web.AppKey("pool", concurrent.futures.ThreadPoolExecutor)
log = logging.getLogger(__name__)


@dataclasses.dataclass
class Limits:
    """The per-request bounds (see the module's docstring) and the bytes held now."""

    max_batch: int
    max_body: int
    body_timeout: float
    max_inflight: int
    containers: int  # most ``{`` and ``[`` a body of max_batch examples needs
    inflight: int = 0


LIMITS = web.AppKey("limits", Limits)


class _Refused(Exception):
    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


def _error(status: int, msg: str, close: bool = False) -> web.Response:
    if len(msg) > MAX_ERROR_CHARS:
        msg = msg[: MAX_ERROR_CHARS - 3] + "..."
    r = web.json_response({"error": msg}, status=status)
    if close:  # the body was not read whole: the connection cannot carry another request
        r.force_close()
    return r


async def _read(request: web.Request, lim: Limits, held: list[int]) -> bytearray:
    """The body, within ``max_body``, ``body_timeout`` and the bytes in flight (``held[0]``:
    this request's share of ``lim.inflight``, given back by the caller). A body's first
    ``SMALL_BODY`` bytes are its connection's (not counted), so clients holding the budget with
    large slow bodies never shut out small requests."""
    size = request.content_length
    if size is not None and size > lim.max_body:
        raise _Refused(413, f"the body is {size} bytes, at most {lim.max_body} (--max-body)")
    charset = (request.charset or "utf-8").lower()
    if charset not in ("utf-8", "utf8"):
        raise _Refused(400, f"charset {show(charset)}: send UTF-8 JSON")
    buf = bytearray()
    try:
        async with asyncio.timeout(lim.body_timeout):
            while chunk := await request.content.readany():
                if len(buf) + len(chunk) > lim.max_body:
                    raise _Refused(413, f"the body is over {lim.max_body} bytes (--max-body)")
                extra = max(len(buf) + len(chunk) - SMALL_BODY, 0) - held[0]
                if extra and lim.inflight + extra > lim.max_inflight:
                    raise _Refused(
                        503,
                        f"overloaded: {lim.inflight} bytes of bodies in flight "
                        f"(max {lim.max_inflight}); retry later",
                    )
                lim.inflight += extra
                held[0] += extra
                buf += chunk
    except TimeoutError:
        raise _Refused(
            408, f"the body took over {lim.body_timeout:g} s to arrive ({len(buf)} bytes read)"
        ) from None
    except _Refused:
        raise
    except Exception as e:  # noqa: BLE001 - a connection lost, a malformed chunk: aiohttp's kinds
        raise _Refused(400, f"the body could not be read ({type(e).__name__})") from None
    return buf


def _decode(model: Model | NextItemModel, raw: bytearray, lim: Limits) -> tuple:
    """``(entry, inputs, finish)`` of a body (in a thread): the batcher's entry and inputs,
    and ``finish(outputs, counts) -> answer``, which adds the request's counts."""
    containers = raw.count(b"{") + raw.count(b"[")  # before parsing: C speed, no objects
    if containers > lim.containers:
        holds = (
            "a history request holds"
            if isinstance(model, NextItemModel)
            else f"{lim.max_batch} examples (max_batch) hold"
        )
        raise ArtifactError(f"the body has {containers} objects and arrays, more than {holds}")
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise ArtifactError(
            f"the body is not UTF-8: byte {e.start}: {show(bytes(raw[e.start : e.start + 8]))}"
        ) from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise ArtifactError("the body is not JSON we read: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError; an integer past 4,300 digits
        raise ArtifactError(f"the body is not JSON: {show(str(e))[1:-1]}") from None
    del text
    if isinstance(model, NextItemModel):
        if not isinstance(body, dict):
            raise ArtifactError("the body must be a JSON object with a history")
        return _next_item(model, body)
    if not isinstance(body, dict):
        raise ArtifactError("the body must be a JSON object with examples (or dense and ids)")
    enc: dict[str, Any] = {"unseen_values": 0, "missing_features": 0}
    if "examples" in body:
        examples = body["examples"]
        if set(body) != {"examples"} or not isinstance(examples, list):
            raise ArtifactError('expected {"examples": [...]} and nothing else')
        if not examples:
            raise ArtifactError("examples is empty")
        _count(len(examples), lim)
        dense, ids, enc = model.encode(examples)
    elif set(body) == {"dense", "ids"}:
        dense, ids = body["dense"], body["ids"]  # checked (and named in errors) below
        _count(len(dense) if isinstance(dense, list) else 0, lim)
    else:
        raise ArtifactError(
            f"unknown fields {show(sorted(body))}: expected examples, or dense and ids"
        )
    dense, ids, oov = model.check(dense, ids)

    def finish(scores: np.ndarray, counts: dict) -> dict:
        for k, v in enc.items():
            counts[k] = counts.get(k, 0) + v
        counts["out_of_vocab_ids"] += oov
        return {"scores": [float(s) for s in scores], **enc}

    return "", (dense, ids), finish


def _next_item(model: NextItemModel, body: dict) -> tuple:
    """:func:`_decode` of a next-item request (the module's docstring)."""
    unknown = sorted(set(body) - set(NEXT_ITEM_FIELDS))
    if unknown:
        raise ArtifactError(
            f"unknown field {show(unknown[0])} (expected {', '.join(NEXT_ITEM_FIELDS)})"
        )
    if "history" not in body:
        raise ArtifactError("history: missing (a list of item ids, oldest first)")
    items, length, cut = model.history(body["history"])
    hist = (items[None], np.array([length], np.int32))
    if "candidates" in body:
        if "k" in body or "exclude_history" in body:
            raise ArtifactError(
                "candidates: scored as given; k and exclude_history are a top-K request's"
            )
        cands, n = model.candidates(body["candidates"])

        def scored(scores: np.ndarray, counts: dict) -> dict:
            counts["truncated_events"] += cut
            return {"scores": [float(s) for s in scores[0, :n]], "truncated_events": cut}

        return next_item.SCORE, (*hist, cands[None]), scored
    k = model.k(body.get("k", min(DEFAULT_K, model.max_k)))
    exclude = body.get("exclude_history", True)
    if not isinstance(exclude, bool):
        raise ArtifactError(
            f"exclude_history: expected true or false, got {type(exclude).__name__} {show(exclude)}"
        )

    def ranked(out: tuple, counts: dict) -> dict:
        ids, scores = out[0][0, :k], out[1][0, :k]
        real = np.isfinite(scores)  # fewer than k items left once the history is excluded
        counts["truncated_events"] += cut
        return {
            "items": ids[real].tolist(),
            "scores": [float(s) for s in scores[real]],
            "truncated_events": cut,
        }

    return next_item.TOP_K, (*hist, np.array([exclude])), ranked


def _count(n: int, lim: Limits) -> None:
    if n > lim.max_batch:
        raise ArtifactError(f"a request of {n} examples exceeds max_batch={lim.max_batch}")


async def predict(request: web.Request) -> web.Response:
    app = request.app
    model, batcher, counts, lim = app[MODEL], app[BATCHER], app[COUNTS], app[LIMITS]
    held = [0]
    try:
        try:
            raw = await _read(request, lim, held)
        except _Refused as e:
            if e.status == 503:
                batcher.stats.shed += 1
            else:
                counts["malformed"] += 1
            return _error(e.status, str(e), close=True)
        loop = asyncio.get_running_loop()
        try:
            entry, inputs, finish = await loop.run_in_executor(app[POOL], _decode, model, raw, lim)
        except ArtifactError as e:
            counts["malformed"] += 1
            return _error(400, str(e))
        except Exception as e:  # noqa: BLE001 - a bug of ours: one line, no traceback sent
            log.error("predict: %s", show(f"{type(e).__name__}: {e}"))
            counts["internal_errors"] += 1
            return _error(500, f"internal error ({type(e).__name__})")
    finally:
        lim.inflight -= held[0]
    del raw
    try:
        out = await batcher.score(*inputs, entry=entry)
    except Overloaded as e:
        return _error(503, str(e))
    # counted for answered requests only (a shed request is sent again)
    return web.json_response(finish(out, counts))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    lim = app[LIMITS]
    return web.json_response(
        {**app[BATCHER].stats.as_dict(), **app[COUNTS], "inflight_bytes": lim.inflight}
    )


def body_bounds(max_batch: int, max_body: int = 0, max_inflight: int = 0) -> tuple[int, int]:
    """``(max_body, max_inflight)``, each given or (0) derived: ``max_batch`` x ``EXAMPLE_BYTES``
    + 64 KiB, and 16 bodies of it."""
    max_body = max_body or max_batch * EXAMPLE_BYTES + (64 << 10)
    return max_body, max_inflight or 16 * max_body


CONNECTION_BYTES = 600 << 10
"""Memory one open connection may hold beyond :func:`memory_bound`: a head at its bounds, held
as about twice its bytes, and the first ``SMALL_BODY`` bytes of its body (0.52 MiB measured with
tracemalloc; 0.13 MiB with a plain head)."""


def memory_bound(
    *,
    max_batch: int,
    max_body: int,
    max_inflight: int,
    cache_bytes: int,
    max_queue: int,
    workers: int,
    example_values: int,
) -> int:
    """Bytes the server may hold above its idle self, ``CONNECTION_BYTES`` a connection apart
    (the README's bound): bodies being read (``max_inflight``); bodies being decoded, in each of
    ``ENCODERS`` threads a body and its JSON, measured at up to 13x its bytes (14 x
    ``max_body`` each); the row encoder's cache; and encoded examples of ``example_values``
    4-byte values each (N + F x H: float32 dense, int32 ids), ``max_queue`` of them waiting or
    being scored and each worker's batch again, concatenated and padded to a power of two (3 x
    ``max_batch``)."""
    queue = (max_queue + 3 * workers * max_batch) * example_values * 4
    return max_inflight + ENCODERS * 14 * max_body + cache_bytes + queue


def load_model(path: str | Path, cache_bytes: int = CACHE_BYTES) -> Model | NextItemModel:
    """The artifact at ``path``, by its manifest's ``task``: a next-item model's loader or the
    CTR one (which names what is wrong with a manifest it cannot read)."""
    try:
        task = json.loads((Path(path) / MANIFEST).read_text()).get("task")
    except (OSError, ValueError, AttributeError):
        task = None
    if task == next_item.TASK:
        return NextItemModel.load(path)
    return Model.load(path, cache_bytes=cache_bytes)


def make_app(
    model: Model | NextItemModel,
    *,
    max_batch: int = 256,
    max_wait: float = 0.002,
    max_queue: int = 4096,
    workers: int = 1,
    max_body: int = 0,
    body_timeout: float = 5.0,
    max_inflight: int = 0,
    idle_timeout: float = IDLE_TIMEOUT,
) -> web.Application:
    """The server's application (``web.run_app`` it, or ``aiohttp.test_utils`` in tests);
    ``max_body`` and ``max_inflight`` 0: derived from ``max_batch`` (the module's docstring)."""
    max_body, max_inflight = body_bounds(max_batch, max_body, max_inflight)
    if max_body < 1 or max_inflight < max_body or body_timeout <= 0:
        raise ValueError(
            f"server: max_body={max_body} >= 1, max_inflight={max_inflight} >= max_body, "
            f"body_timeout={body_timeout} > 0"
        )
    if isinstance(model, NextItemModel):
        predict_fn: Any = {
            next_item.TOP_K: model.top_k_checked,
            next_item.SCORE: model.score_checked,
        }
        containers = NEXT_ITEM_CONTAINERS
        counts = {"truncated_events": 0}
    else:
        predict_fn = model.predict_checked
        per_example = 2 * len(model.features) + 8  # bags as lists, the example, dense, features
        containers = 8 + max_batch * per_example
        counts = {"unseen_values": 0, "missing_features": 0, "out_of_vocab_ids": 0}
    batcher = DynamicBatcher(
        predict_fn,
        max_batch=max_batch,
        max_wait=max_wait,
        max_queue=max_queue,
        workers=workers,
    )
    # after a refused body, aiohttp reads (and drops) what the client still sends, at most
    # LINGER seconds, before closing: the client then reads the answer instead of a reset
    app = web.Application(
        client_max_size=max_body,
        handler_args={
            "lingering_time": LINGER,
            "keepalive_timeout": idle_timeout,
            "max_line_size": MAX_LINE,
            "max_field_size": MAX_FIELD,
            "max_headers": MAX_FIELDS,
        },
    )
    app[MODEL], app[BATCHER] = model, batcher
    app[LIMITS] = Limits(max_batch, max_body, body_timeout, max_inflight, containers)
    app[COUNTS] = {"malformed": 0, "malformed_heads": 0, "internal_errors": 0, **counts}
    head_errors = _HeadErrors(app[COUNTS])
    app.router.add_post("/predict", predict)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)

    async def start(app: web.Application) -> None:
        app[POOL] = concurrent.futures.ThreadPoolExecutor(ENCODERS, thread_name_prefix="encode")
        batcher.start()
        logging.getLogger("aiohttp.server").addFilter(head_errors)

    async def stop(app: web.Application) -> None:
        logging.getLogger("aiohttp.server").removeFilter(head_errors)
        await batcher.close()
        app[POOL].shutdown(wait=True)

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


class _HeadErrors(logging.Filter):
    """aiohttp logs a head it cannot parse (too long, too many fields, not HTTP) at ERROR with
    its traceback, one per request, which a hostile client turns into a flood of the log; this
    drops those records and counts them (``/metrics``: ``malformed_heads``) while this server
    runs. Every other record passes."""

    def __init__(self, counts: dict[str, int]):
        super().__init__()
        self.counts = counts

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], HttpProcessingError):
            self.counts["malformed_heads"] += 1
            return False
        return True
