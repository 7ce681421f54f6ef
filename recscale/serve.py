"""``python -m recscale.serve MODEL [--host H] [--port P] [--max-batch N] [--max-wait-ms T]
[--max-queue Q] [--workers W] [--max-body B] [--body-timeout-s S] [--max-inflight I]
[--cache-mb C]``: an HTTP server of an exported model, a CTR model's or a next-item model's
(``recscale.serving.server``, which says what each request holds and what each bound refuses
and with which status)."""

from __future__ import annotations

import dataclasses
import gc
import sys
import time

import tyro


@dataclasses.dataclass(frozen=True)
class ServeArgs:
    """Serve an exported model (``python -m recscale.export``) over HTTP."""

    model: tyro.conf.Positional[str]
    """The artifact's directory."""
    host: str = "127.0.0.1"
    port: int = 8080
    max_batch: int = 256
    """Most examples scored in one batch."""
    max_wait_ms: float = 2.0
    """Longest a request waits for others to join its batch."""
    max_queue: int = 4096
    """Most examples waiting; a request beyond it is refused with 503 (shed)."""
    workers: int = 1
    """Batches scored at once (co-located model instances sharing the weights)."""
    max_body: int = 0
    """Largest request body in bytes (413 beyond); 0: max_batch x 8 KiB + 64 KiB."""
    body_timeout_s: float = 5.0
    """Longest a request's body may take to arrive (408 and the connection closed beyond)."""
    max_inflight: int = 0
    """Most bytes of bodies being read or decoded at once (503 beyond); 0: 16 x max_body."""
    cache_mb: float = 64.0
    """Memory of the raw-row encoder's cache of known values (MiB)."""


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(ServeArgs, args=argv, prog="python -m recscale.serve")
    from aiohttp import web  # noqa: PLC0415

    from recscale.serving.runtime import ArtifactError  # noqa: PLC0415
    from recscale.serving.server import load_model, make_app  # noqa: PLC0415

    try:
        model = load_model(args.model, cache_bytes=int(args.cache_mb * 2**20))
        app = make_app(
            model,
            max_batch=args.max_batch,
            max_wait=args.max_wait_ms / 1e3,
            max_queue=args.max_queue,
            workers=args.workers,
            max_body=args.max_body,
            body_timeout=args.body_timeout_s,
            max_inflight=args.max_inflight,
        )
    except (ArtifactError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    t0 = time.perf_counter()
    sizes = model.warmup(args.max_batch)  # no request waits for a compilation
    # Everything alive now (jax, the weights, the vocabularies) leaves the collector's view: a
    # full collection would otherwise walk it, a pause of 150 ms measured on a Frappe model, in
    # the latency of whichever requests wait meanwhile (benchmarks/serving.py --raw).
    gc.collect()
    gc.freeze()
    print(
        f"compiled batch sizes {sizes[0]}-{sizes[-1]} in {time.perf_counter() - t0:.1f} s; "
        f"serving {args.model} on http://{args.host}:{args.port}/predict",
        file=sys.stderr,
    )
    try:
        web.run_app(app, host=args.host, port=args.port, print=None)
    except OSError as e:  # e.g. the port is taken
        raise SystemExit(f"error: {args.host}:{args.port}: {e.strerror or e}") from None


if __name__ == "__main__":
    main()
