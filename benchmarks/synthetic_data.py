"""The synthetic generator's cost per example: its C kernel against its numpy path.

``python benchmarks/synthetic_data.py [--repeats 7] [--batches 40]`` times
``SyntheticGenerator.examples`` (ids, dense values, teacher terms and labels) for the data of the
showcase (``make run``, batch 1,024) and of the scaling study (batch 256, and 1,024), both ways
in the same process, the best of ``--repeats`` runs of ``--batches`` batches each, checks that
both ways give the same bits, and prints microseconds per example and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.synthetic import SyntheticGenerator  # noqa: E402
from sweeps.specs import showcase, study  # noqa: E402


def _time(gen: SyntheticGenerator, batch: int, batches: int, repeats: int) -> float:
    """Best seconds per example over ``repeats`` runs of ``batches`` consecutive batches."""
    gen.train_batch(0, batch)
    best = float("inf")
    for r in range(repeats):
        t = time.perf_counter()
        for s in range(batches):
            gen.train_batch(r * batches + s, batch)
        best = min(best, (time.perf_counter() - t) / (batches * batch))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batches", type=int, default=40)
    args = ap.parse_args()
    cases = (
        ("showcase", showcase.DATA.synthetic, 1024),
        ("study", study.DATA.synthetic, 256),
        ("study", study.DATA.synthetic, 1024),
    )
    print(f"{'data':<10}{'batch':>7}{'numpy us/ex':>14}{'C us/ex':>10}{'ratio':>8}")
    for name, cfg, batch in cases:
        native = SyntheticGenerator(cfg, seed=0)
        if native._native is None:
            sys.exit("the C kernel is not built here (no C compiler, or RECSCALE_CPU_KERNELS=0)")
        plain = SyntheticGenerator(cfg, seed=0)
        plain._native = None
        a, b = native.train_batch(3, batch), plain.train_batch(3, batch)
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), "paths differ"
        t_np = _time(plain, batch, args.batches, args.repeats)
        t_c = _time(native, batch, args.batches, args.repeats)
        print(f"{name:<10}{batch:>7}{t_np * 1e6:>14.2f}{t_c * 1e6:>10.2f}{t_np / t_c:>7.2f}x")


if __name__ == "__main__":
    main()
