"""``python -m recscale.serve MODEL [--host H] [--port P] [--max-batch N] [--max-wait-ms T]
[--max-queue Q] [--workers W]``: an HTTP server of an exported model
(``recscale.serving.server``)."""

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


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(ServeArgs, args=argv, prog="python -m recscale.serve")
    from aiohttp import web  # noqa: PLC0415

    from recscale.serving.runtime import ArtifactError, Model  # noqa: PLC0415
    from recscale.serving.server import make_app  # noqa: PLC0415

    try:
        model = Model.load(args.model)
        app = make_app(
            model,
            max_batch=args.max_batch,
            max_wait=args.max_wait_ms / 1e3,
            max_queue=args.max_queue,
            workers=args.workers,
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
