"""The measured cost table the learned sharding cost model trains on (issue 39).

``python benchmarks/cost_table.py [--out benchmarks/cost_tables/cpu-2core_v1.jsonl.gz]
[--minutes 45] [--seed 0]``

Each sample is one device's shard set and its measured step time: the engine's pool and fused
backward + row-wise Adagrad update of every buffer the shards form
(``recscale.embeddings.shard_cost.measure``: the C++ kernels on this CPU; on a GPU the Pallas
kernels ``auto`` picks there). Shard sets come from NeuroShard-style tasks
(``_planner_tasks``: 10-60 tables from the Criteo, MLPerf multi-hot and dlrm_datasets-shaped
pools, 4 or 8 devices, batch 2,048-8,192, uniform or skewed ids), cut by plans whose sharding
type per table is drawn at random (table-, column-, row-wise or data-parallel, placed by the
planner's greedy placement under the task's memory cap) and, for a third of the tasks, the
analytic planner's own plan; each device's set is a sample, and half the time a random subset
of it as well (NeuroShard's augmentation). Samples cover what the planners are asked about:
the features ``shard_cost.ShardWork`` names, the number of tables on a device, and the padding
of every bag to the task's widest.

The file is versioned: its first line records the format version, the machine (CPU model,
cores, jax version, backend, device kind) and the kernels; each further line is one sample.
Appends, so a run can be continued (``--seed`` a new one); stops after ``--minutes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _planner_tasks as tasks_lib  # noqa: E402

from recscale.embeddings import planner, shard_cost  # noqa: E402
from tpu_gpu_configs.profiles import get_profile  # noqa: E402

VERSION = 1
MAX_SET_BYTES = 4 << 30
"""Device sets beyond this are not timed (this machine's 24 GiB holds one at a time)."""
KIND_WEIGHTS = {"table_wise": 0.45, "column_wise": 0.2, "row_wise": 0.2, "data_parallel": 0.15}


def machine() -> dict:
    import jax  # noqa: PLC0415

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os  # noqa: PLC0415

    dev = jax.devices()[0]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": dev.platform,
        "device_kind": dev.device_kind,
    }


def planner_tables(task: tasks_lib.Task, pins: dict[str, str] | None = None):
    return [
        planner.PlannerTable(
            name=t.name,
            num_rows=t.rows,
            dim=t.dim,
            pooling_factor=float(t.hotness),
            zipf_exponent=t.zipf,
            allowed=(pins[t.name],) if pins and t.name in pins else (),
        )
        for t in task.tables
    ]


def task_profile(task: tasks_lib.Task, base: str = "cpu-2core"):
    """The planner's profile for a task: ``base`` with the task's memory cap."""
    prof = get_profile(base)
    return dataclasses.replace(prof, memory_bytes=task.memory_cap / planner.MEMORY_FRACTION)


def random_plan(task: tasks_lib.Task, rng: np.random.Generator):
    """A plan whose sharding type per table is drawn (``KIND_WEIGHTS``), placed greedily; a
    draw the memory cap refuses is drawn again (after 4 tries: the analytic plan)."""
    prof = task_profile(task)
    kinds, weights = zip(*KIND_WEIGHTS.items(), strict=True)
    for _ in range(4):
        pins = {t.name: str(rng.choice(kinds, p=weights)) for t in task.tables}
        for t in task.tables:  # a column split needs slices at least 4 wide
            if pins[t.name] == "column_wise" and t.dim < 8:
                pins[t.name] = "table_wise"
        try:
            return planner.plan(
                planner_tables(task, pins), prof, task.devices, batch_size=task.batch
            )
        except ValueError:
            continue
    return planner.plan(planner_tables(task), prof, task.devices, batch_size=task.batch)


def row(task, shards, seconds, seed) -> dict:
    return {
        "task": task.name,
        "seed": seed,
        "devices": task.devices,
        "batch": task.batch,
        "pad": task.pad_hotness,
        "seconds": seconds,
        "shards": [
            [s.table_rows, s.rows, s.row_start, s.width, s.bags, s.hotness, s.zipf, s.kind]
            for s in shards
        ],
    }


def samples(seed: int):
    """Endless ``(task, device set)`` pairs (see the module docstring)."""
    rng = np.random.default_rng(seed)
    i = 0
    while True:
        task = tasks_lib.draw_task(
            rng,
            f"s{seed}_t{i}",
            num_tables=int(rng.integers(10, 61)),
            devices=int(rng.choice([4, 8])),
            skewed=bool(rng.random() < 0.5),
            batch=int(rng.choice([2048, 4096, 8192])),
        )
        i += 1
        plans = [random_plan(task, rng)]
        if rng.random() < 1 / 3:
            plans.append(
                planner.plan(
                    planner_tables(task), task_profile(task), task.devices, batch_size=task.batch
                )
            )
        for p in plans:
            sets = shard_cost.device_work(p, planner_tables(task), task.devices, task.batch)
            for d in rng.permutation(len(sets)):
                if not sets[d]:
                    continue
                yield task, sets[d]
                if len(sets[d]) > 1 and rng.random() < 0.5:
                    keep = rng.random(len(sets[d])) < rng.uniform(0.2, 0.8)
                    if keep.any():
                        yield task, [s for s, k in zip(sets[d], keep, strict=True) if k]


def remeasure(path: Path, count: int, repeats: int, seed: int, times: int, model: str) -> None:
    """Times ``count`` random samples of the table at ``path`` again, ``times`` times each, with
    the ids they were timed with (a row's ``seed``; rows written before it was recorded: the
    line index, which is right for a table's first run only). With ``model``: the samples are
    drawn from its held-out tasks, and both models' error is printed against the single timing
    and against the mean of all the timings (the noise of one timing averaged down)."""
    from recscale.embeddings import learned_cost  # noqa: PLC0415
    from tpu_gpu_configs.profiles import get_profile  # noqa: PLC0415

    _, table = learned_cost.load_table(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        seeds = [json.loads(line).get("seed", i) for i, line in enumerate(f.readlines()[1:])]
    index = list(range(len(table)))
    if model:
        predictor = learned_cost.CostPredictor.load(model)
        held = {s.task for s in learned_cost.split_by_task(table)[1]}
        index = [i for i in index if table[i].task in held]
    rng = np.random.default_rng(seed)
    pick = rng.choice(index, min(count, len(index)), replace=False)
    first, mean = [], []
    for i in pick:
        smp = table[i]
        runs = [
            shard_cost.measure(
                list(smp.shards), pad_hotness=smp.pad, repeats=repeats, seed=int(seeds[i])
            )
            for _ in range(times)
        ]
        first.append(runs[0])
        mean.append(float(np.mean([smp.seconds, *runs])))
    orig = np.array([table[i].seconds for i in pick])
    rel = np.abs(np.asarray(first) - orig) / orig
    print(
        f"{path}: {rel.size} samples timed again: relative change median {np.median(rel):.1%}, "
        f"mean {rel.mean():.1%}, 90th percentile {np.percentile(rel, 90):.1%}"
    )
    if not model:
        return
    mean = np.asarray(mean)
    prof = get_profile(predictor.meta.get("profile", "cpu-2core"))
    factor = float(predictor.meta["analytic_lookup_factor"])
    sets = [(list(table[i].shards), table[i].pad) for i in pick]
    learned = np.array([predictor.seconds(s, p) for s, p in sets])
    analytic = np.array([learned_cost.analytic_device(s, prof, factor) for s, _ in sets])
    for name, target in (("the table's timing", orig), (f"the mean of {times + 1} timings", mean)):
        print(
            f"  against {name}: learned MAPE {learned_cost.mape(learned, target):.1%}, analytic "
            f"{learned_cost.mape(analytic, target):.1%}; one timing's own error "
            f"{learned_cost.mape(orig, mean):.1%}"
        )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/cost_tables/cpu-2core_v1.jsonl.gz")
    ap.add_argument("--minutes", type=float, default=45.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--remeasure",
        type=int,
        default=0,
        help="instead: time N of the table's samples again and print how much they moved "
        "(the noise floor of any model's error)",
    )
    ap.add_argument("--times", type=int, default=1, help="--remeasure: timings per sample")
    ap.add_argument("--model", default="", help="--remeasure: judge this model on held-out samples")
    args = ap.parse_args(argv)
    if args.remeasure:
        return remeasure(
            Path(args.out), args.remeasure, args.repeats, args.seed, args.times, args.model
        )
    from rich.progress import Progress  # noqa: PLC0415

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if out.suffix == ".gz" else open  # gzip: appends add members
    if not out.exists():
        header = {"version": VERSION, "machine": machine(), "kernels": "auto"}
        with opener(out, "wt") as f:
            f.write(json.dumps(header) + "\n")
    else:
        with opener(out, "rt") as f:
            header = json.loads(f.readline())
        if header.get("version") != VERSION or header.get("machine") != machine():
            raise SystemExit(f"{out}: written by another version or machine; use a new --out")
    deadline = time.time() + 60 * args.minutes
    n = skipped = 0
    with opener(out, "at") as f, Progress() as bar:
        job = bar.add_task("device sets timed", total=None)
        for task, shards in samples(args.seed):
            if time.time() > deadline:
                break
            if sum(s.bytes + 4 * s.rows for s in shards) > MAX_SET_BYTES:
                skipped += 1
                continue
            seed = args.seed * 1_000_000 + n  # the ids' seed, kept for --remeasure
            seconds = shard_cost.measure(
                shards, pad_hotness=task.pad_hotness, repeats=args.repeats, seed=seed
            )
            f.write(json.dumps(row(task, shards, seconds, seed)) + "\n")
            f.flush()
            n += 1
            bar.update(job, advance=1)
    print(f"{out}: {n} device sets timed, {skipped} over {MAX_SET_BYTES >> 30} GiB not timed")


if __name__ == "__main__":
    main()
