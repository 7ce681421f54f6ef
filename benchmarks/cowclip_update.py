"""The engine's sparse update with CowClip: its row path (what ran with a clip until the update
kernels clipped) against the update kernel with the clip inside, on this machine's default
device.

``python benchmarks/cowclip_update.py [--batch 2048] [--dim 64] [--hotness 1 20] [--reps 5]
[--optimizers rowwise_adagrad sgd]``

One engine buffer as the engine calls the update on one device: ``--tables`` slots of
``--rows`` rows each (``[S·R, D]`` float32, row-wise Adagrad accumulators), ``B`` bags per slot
of ``H`` ids drawn uniformly, the bags' gradients, CowClip (ratio 1, floor 1e-5) with the
touched rows' L2 (1e-4). Per case, each path's best of ``--reps`` rounds of 3 calls after a
warm-up, the paths taking turns within each round (so that load from elsewhere falls on all of
them alike), each on its own donated buffer:

* ``row path``: ``recscale.embeddings.update``'s branch for column-split tables and lazy Adam,
  which every CowClip step took before: distinct rows and their counts by one scatter, then
  ``_clip_rows`` + ``_update_rows``;
* ``kernel auto``: ``recscale.kernels.embedding_update.api.update(..., clip=...)`` as the engine
  now calls it (on CPU: the C++ kernel for multi-id bags, the XLA reference for one-id bags;
  on GPU/TPU the verified Pallas kernel);
* ``kernel xla`` / ``kernel cpu_ffi``: the two CPU implementations named;
* ``no clip``: the auto kernel without the clip (what the clip costs inside it).

It prints milliseconds and the row path's time over each (above 1: faster than the row path).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from recscale.embeddings import update as engine_update  # noqa: E402
from recscale.kernels import common  # noqa: E402
from recscale.kernels.embedding_update import api as update_api  # noqa: E402
from recscale.kernels.embedding_update import reference  # noqa: E402
from recscale.optim.cowclip import CowClip  # noqa: E402

LR = 0.01
CLIP = CowClip(ratio=1.0, min_norm=1e-5, row_l2=1e-4)


def best_times(fns: dict, reps: int, runs: int = 3) -> dict[str, float]:
    """Each ``fn()``'s best wall time (outputs blocked on) over ``reps`` rounds after one
    warm-up, the functions taking turns within a round, ``runs`` calls each (the first call
    after another path pays for the caches and pages that path took)."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            for _ in range(runs):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def row_path(rule, num_slots: int, width: int):
    """The engine's row path with the clip, one device's slots (``apply_update``'s ``else``)."""

    def run(buf, acc, keys_sbh, g_sbw):
        ones = jnp.ones(g_sbw.shape[:-1] + (1,), jnp.float32)
        g = jnp.concatenate([g_sbw, ones], axis=-1)
        uids, grad = reference.batched_row_gradients(keys_sbh, g, buf.shape[0])
        grad, count = grad[..., :-1], grad[..., -1]
        st = {} if acc is None else {"acc": acc}
        new_buf, st, sq = engine_update._update_rows(
            buf,
            st,
            uids,
            grad,
            jnp.zeros((num_slots,), jnp.int32),
            jnp.full((num_slots,), width, jnp.int32),
            LR,
            jnp.zeros((), jnp.int32),
            rule,
            0,
            count,
        )
        return new_buf, st.get("acc"), jnp.stack([sq, jnp.sum(grad * grad)])

    return run


def kernel_path(rule, impl: str, clip):
    """The update kernel as ``apply_update`` calls it on whole rows."""

    def run(buf, acc, keys_sbh, g_sbw):
        s, b, h = keys_sbh.shape
        return update_api.update(
            buf,
            acc,
            keys_sbh.reshape(s * b, h),
            g_sbw.reshape(s * b, -1),
            LR,
            optimizer=rule.optimizer,
            eps=rule.eps,
            clip=clip,
            impl=impl,
        )

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hotness", nargs="+", type=int, default=[1, 20])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--optimizers", nargs="+", default=["rowwise_adagrad"], choices=reference.OPTIMIZERS
    )
    args = ap.parse_args()
    s, r, b, d = args.tables, args.rows, args.batch, args.dim
    paths = {"row path": None, "kernel auto": ("auto", CLIP), "no clip": ("auto", None)}
    if jax.default_backend() == "cpu":
        paths |= {"kernel xla": ("xla", CLIP), "kernel cpu_ffi": ("cpu_ffi", CLIP)}
    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); buffer {s} x "
        f"{r:,} rows x {d} float32, {b} bags per slot, {CLIP}"
    )
    print("| optimizer | H | " + " | ".join(f"{p} ms" for p in paths) + " | row path / each |")
    print("|---|---|" + "---|" * len(paths) + "---|")
    key = jax.random.key(0)
    for opt in args.optimizers:
        rule = engine_update.UpdateRule(opt, clip=CLIP)
        for h in args.hotness:
            k1, k2, k3 = jax.random.split(jax.random.fold_in(key, h), 3)
            keys = jax.random.randint(k1, (s, b, h), 0, r, jnp.int32)
            keys = keys + (jnp.arange(s, dtype=jnp.int32) * r)[:, None, None]  # slots disjoint
            g = jax.random.normal(k2, (s, b, d), jnp.float32)
            steps = {}
            for name, spec in paths.items():
                fn = row_path(rule, s, d) if spec is None else kernel_path(rule, *spec)
                f = jax.jit(fn, donate_argnums=(0, 1))
                buf = jax.random.normal(k3, (s * r, d), jnp.float32) * 0.01
                state = [buf, jnp.zeros((s * r,), jnp.float32) if opt != "sgd" else None]

                def step(f=f, state=state, keys=keys, g=g):
                    state[0], state[1], sq = f(state[0], state[1], keys, g)
                    return sq

                steps[name] = step
            times = best_times(steps, args.reps)
            del steps
            ratios = ", ".join(
                f"{n}: {times['row path'] / t:.2f}" for n, t in times.items() if n != "row path"
            )
            cells = " | ".join(f"{1e3 * t:.1f}" for t in times.values())
            print(f"| {opt} | {h} | {cells} | {ratios} |", flush=True)
    print(f"fallbacks: {dict(common.FALLBACKS) or 'none'}")


if __name__ == "__main__":
    main()
