"""Plans judged by measuring them (issue 39): random, greedy, analytic and learned planners on
NeuroShard-style tasks, each plan's devices timed with the engine's kernels on this machine.

``python benchmarks/planner_quality.py [--model recscale/embeddings/cost_models/cpu-2core.npz]
[--tables 10 20 40 60] [--devices 4 8] [--seed 1000] [--out runs/planner_quality]``

Tasks (``_planner_tasks``; seeds unlike the cost table's, so no task was trained on): every
table count x device count, uniform and skewed ids, batch 4,096, a memory cap per device. Per
task, the plans of:

* ``random``: tables table-wise on random devices with room;
* ``greedy_size``: tables table-wise, largest first, each on the device with the least memory
  used (TorchRec's size-greedy partitioner);
* ``greedy_lookup``: the same by lookups per step (ids x width), on the device with the fewest;
* ``analytic``: ``recscale.embeddings.planner.plan`` with the lookup factor the learned model's
  training fitted to the same cost table (its best calibration);
* ``learned``: ``recscale.embeddings.learned_planner.plan`` with the learned model.

A table the heuristics cannot place whole goes row-wise over all devices. Each plan's
**measured cost** is the slowest device's measured kernel time (``shard_cost.measure`` of its
shard set) plus its communication (the planner's analytic bytes over the profile's links, the
same for every method: nothing here can measure an all-to-all between simulated devices);
**predicted** costs are both models' (the analytic one for every plan, the learned one too);
**regret** is the measured cost over the best plan's of the task, less 1; **planning time** the
planner call's wall time. Prints a table per task and a summary (geometric-mean ratios of
learned to analytic, the models' error over the plans' devices and their rank correlation over
the plans), writes ``results.json`` and ``regret.png`` to ``--out``; then plans 100 tables on
8 devices with the learned planner and prints the time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _planner_tasks as tasks_lib  # noqa: E402
from cost_table import planner_tables, task_profile  # noqa: E402

from recscale.embeddings import learned_cost, learned_planner, planner, shard_cost  # noqa: E402

METHODS = ("random", "greedy_size", "greedy_lookup", "analytic", "learned")


def _placed(t, kind, devs, profile, n, batch, cm) -> planner.TablePlan:
    (cand,) = [
        c
        for c in planner.candidates(
            dataclasses.replace(t, allowed=(kind,)), n, profile, cm, batch, 1
        )
        if c.n_shards == len(devs)
    ]
    return planner.TablePlan(t.name, kind, planner.shards_of(t, cand, np.asarray(devs)))


def heuristic(tables, profile, n, batch, method: str, rng) -> planner.Plan:
    """Table-wise placement by ``method`` (module docstring), memory-capped."""
    cm = planner.CostModel()
    limit = profile.memory_bytes * planner.MEMORY_FRACTION
    mem, load = np.zeros(n), np.zeros(n)
    size = {t.name: t.num_rows * (t.dim * t.bytes_per_element + 4) for t in tables}
    order = list(tables)
    if method == "random":
        order = [order[i] for i in rng.permutation(len(order))]
    elif method == "greedy_size":
        order.sort(key=lambda t: -size[t.name])
    else:
        order.sort(key=lambda t: -t.pooling_factor * t.dim)
    out = []
    for t in order:
        fits = np.flatnonzero(mem + size[t.name] <= limit)
        if fits.size == 0:  # too big for any device: rows over all of them
            tp = _placed(t, "row_wise", list(range(n)), profile, n, batch, cm)
            mem += tp.shards[0].memory_bytes
        else:
            if method == "random":
                d = int(rng.choice(fits))
            elif method == "greedy_size":
                d = int(fits[np.argmin(mem[fits])])
            else:
                d = int(fits[np.argmin(load[fits])])
            tp = _placed(t, "table_wise", [d], profile, n, batch, cm)
            mem[d] += size[t.name]
            load[d] += t.pooling_factor * t.dim
        out.append(tp)
    by = {tp.table: tp for tp in out}
    ordered = tuple(by[t.name] for t in tables)
    zeros = np.zeros(n)
    return planner.Plan(ordered, zeros, mem, limit)


def predicted(plan, tables, task, profile, factor, model) -> dict[str, np.ndarray]:
    """Both models' per-device predictions (kernel time + the plan's communication)."""
    sets = shard_cost.device_work(plan, tables, task.devices, task.batch)
    comm = planner.comm_by_device(plan)
    ana = np.array([learned_cost.analytic_device(s, profile, factor) for s in sets]) + comm
    lea = np.array([model.seconds(s, task.pad_hotness) for s in sets]) + comm
    return {"analytic": ana, "learned": lea, "sets": sets, "comm": comm}


def run_task(task, model, factor, rng, repeats: int, base: str) -> dict:
    tables = planner_tables(task)
    profile = task_profile(task, base)
    cm = dataclasses.replace(planner.CostModel.for_profile(profile), lookup=factor)
    plans, plan_s = {}, {}
    for m in METHODS:
        t0 = time.perf_counter()
        if m == "analytic":
            p = planner.plan(tables, profile, task.devices, batch_size=task.batch, cost_model=cm)
        elif m == "learned":
            p = learned_planner.plan(
                tables, profile, task.devices, batch_size=task.batch, predictor=model, cost_model=cm
            )
        else:
            p = heuristic(tables, profile, task.devices, task.batch, m, rng)
        plan_s[m] = time.perf_counter() - t0
        plans[m] = p
    out = {"task": task.name, "tables": len(tables), "devices": task.devices}
    out["skewed"] = task.skewed
    rows = {}
    for m, p in plans.items():
        pr = predicted(p, tables, task, profile, factor, model)
        kernel = np.array(
            [
                shard_cost.measure(s, pad_hotness=task.pad_hotness, repeats=repeats) if s else 0.0
                for s in pr["sets"]
            ]
        )
        measured = kernel + pr["comm"]
        rows[m] = {
            "measured_s": float(measured.max()),
            "predicted_analytic_s": float(pr["analytic"].max()),
            "predicted_learned_s": float(pr["learned"].max()),
            "plan_s": plan_s[m],
            "device_measured_s": measured.tolist(),
            "device_analytic_s": pr["analytic"].tolist(),
            "device_learned_s": pr["learned"].tolist(),
            "kinds": sorted({tp.sharding for tp in p.tables}),
        }
    best = min(r["measured_s"] for r in rows.values())
    for r in rows.values():
        r["regret"] = r["measured_s"] / best - 1
    out["methods"] = rows
    return out


def summary(results: list[dict]) -> dict:
    out = {}
    for label, pick in (("skewed", True), ("uniform", False), ("all", None)):
        rs = [r for r in results if pick is None or r["skewed"] == pick]
        if not rs:
            continue
        ratio = [
            r["methods"]["learned"]["measured_s"] / r["methods"]["analytic"]["measured_s"]
            for r in rs
        ]
        out[label] = {
            "tasks": len(rs),
            "learned_over_analytic_geomean": float(np.exp(np.mean(np.log(ratio)))),
            "mean_regret": {
                m: float(np.mean([r["methods"][m]["regret"] for r in rs])) for m in METHODS
            },
        }
    meas, ana, lea, per_task = [], [], [], {"analytic": [], "learned": []}
    for r in results:
        for m in METHODS:
            x = r["methods"][m]
            meas += x["device_measured_s"]
            ana += x["device_analytic_s"]
            lea += x["device_learned_s"]
        ms = [r["methods"][m]["measured_s"] for m in METHODS]
        for k in per_task:
            per_task[k].append(
                learned_cost.spearman([r["methods"][m][f"predicted_{k}_s"] for m in METHODS], ms)
            )
    keep = np.asarray(meas) > 0
    out["device_mape"] = {
        "analytic": learned_cost.mape(np.asarray(ana)[keep], np.asarray(meas)[keep]),
        "learned": learned_cost.mape(np.asarray(lea)[keep], np.asarray(meas)[keep]),
    }
    out["plan_rank_correlation"] = {k: float(np.nanmean(v)) for k, v in per_task.items()}
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, skew in zip(axes, (False, True), strict=True):
        rs = [r for r in results if r["skewed"] == skew]
        x = np.arange(len(rs))
        for i, m in enumerate(METHODS):
            ax.bar(x + (i - 2) * 0.16, [r["methods"][m]["regret"] for r in rs], 0.16, label=m)
        ax.set_xticks(x, [f"{r['tables']}t/{r['devices']}d" for r in rs], rotation=45)
        ax.set_title(("skewed" if skew else "uniform") + " ids: measured regret")
        ax.set_ylabel("measured cost / best plan's - 1")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(learned_cost.MODELS_DIR / "cpu-2core.npz"))
    ap.add_argument("--tables", type=int, nargs="+", default=[10, 20, 40, 60])
    ap.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="runs/planner_quality")
    ap.add_argument("--profile", default="cpu-2core", help="hardware profile (links, peaks)")
    args = ap.parse_args(argv)
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import track  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    try:
        model = learned_cost.CostPredictor.load(args.model)
    except ValueError as e:
        sys.exit(f"error: {e}")
    factor = float(model.meta["analytic_lookup_factor"])
    rng = np.random.default_rng(args.seed)
    tasks = [
        tasks_lib.draw_task(
            rng,
            f"q{args.seed}_{nt}t_{nd}d_{'skew' if sk else 'unif'}",
            num_tables=nt,
            devices=nd,
            skewed=sk,
        )
        for sk in (False, True)
        for nt in args.tables
        for nd in args.devices
    ]
    results = [
        run_task(t, model, factor, rng, args.repeats, args.profile) for t in track(tasks, "tasks")
    ]
    console = Console()
    t = Table(title="measured cost per plan (ms; regret vs the task's best)")
    t.add_column("task")
    for m in METHODS:
        t.add_column(m, justify="right")
    for r in results:
        t.add_row(
            r["task"],
            *(
                f"{r['methods'][m]['measured_s'] * 1e3:.2f} (+{r['methods'][m]['regret']:.0%})"
                for m in METHODS
            ),
        )
    console.print(t)
    s = summary(results)
    big = tasks_lib.draw_task(rng, "plan100", num_tables=100, devices=8, skewed=True)
    t0 = time.perf_counter()
    learned_planner.plan(
        planner_tables(big),
        task_profile(big, args.profile),
        8,
        batch_size=big.batch,
        predictor=model,
    )
    s["plan_100_tables_8_devices_s"] = time.perf_counter() - t0
    s["plan_s"] = {m: float(np.mean([r["methods"][m]["plan_s"] for r in results])) for m in METHODS}
    console.print_json(json.dumps(s))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"summary": s, "tasks": results}, indent=1))
    plot(results, out / "regret.png")
    print(f"wrote {out / 'results.json'} and {out / 'regret.png'}")


if __name__ == "__main__":
    main()
