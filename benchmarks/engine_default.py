"""The embedding engine, every preset's default, against the per-table reference it replaced.

``python benchmarks/engine_default.py [--presets dlrm/frappe wukong/frappe] [--steps 200]``
trains each preset for ``--steps`` steps twice in this process, with ``embeddings.sharding=off``
(one array per table, whole-table gradients through optax) and ``auto`` (the engine; with the
Frappe presets' coupled L2 its tables stay data-parallel and every row is updated every step,
the same arithmetic), alternating the two ``--repeats`` times, and prints the median
milliseconds per step (compile excluded, from the trainer's ``timings.jsonl``) and the ratio.
Frappe presets read ``../shared/data/frappe``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from recscale import families
from recscale.train.cli import train_main


def _ms_per_step(preset: str, mode: str, steps: int) -> float:
    family = families.of_preset(preset)
    with tempfile.TemporaryDirectory() as wd:
        argv = [
            preset,
            "--workdir",
            wd,
            "--embeddings.sharding",
            mode,
            "--train.num-steps",
            str(steps),
            "--train.eval-every",
            "0",
            "--train.eval-max-batches",
            "1",
            "--train.checkpoint-every",
            str(steps),
            "--train.no-progress",
        ]
        train_main(family, argv)
        row = json.loads((Path(wd) / "timings.jsonl").read_text().splitlines()[-1])
    train = row["phases"]["train"]
    return 1e3 * (train["seconds"] - train["compile_s"]) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["dlrm/frappe"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for preset in args.presets:
        ms: dict[str, list[float]] = {"off": [], "auto": []}
        for _ in range(args.repeats):
            for mode in ms:
                ms[mode].append(_ms_per_step(preset, mode, args.steps))
        off, auto = (statistics.median(ms[m]) for m in ("off", "auto"))
        rows.append(f"| {preset} | {off:.1f} | {auto:.1f} | {auto / off:.2f} |")
    print("| preset | per-table ms/step | engine ms/step | engine / per-table |")
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
