"""The loss surfaces' bootstrap refits: before / after, CPU seconds per committed analysis.

``python benchmarks/surface_refits.py --against REV [--docs study_opt study_pilot] [--rounds 3]``

For each committed analysis named (``docs/NAME``'s results, at its recorded number of bootstrap
replicates), every family's loss surfaces (``sweeps.surface.fit_loss_surface``, free and fixed
floor, as ``sweeps.analyze`` fits them) are fitted in a fresh process of this script run on a
``git archive`` of ``REV`` (before) and on this tree (after), alternating ``--rounds`` times.
Each process reports the CPU seconds (``time.process_time``) of its fits and the replicates
they dropped; the script prints the median of each side and their ratio. The data are read
from this tree's ``docs/`` in both, so both sides fit the same cells.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The tree whose code is timed: this repository, or (``--root``) a ``git archive`` of another.
ROOT = (
    Path(sys.argv[sys.argv.index("--root") + 1]).resolve()
    if "--root" in sys.argv
    else Path(__file__).resolve().parent.parent
)
HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _child(names: list[str]) -> None:
    """Fit every family's surfaces of each analysis; one JSON line per analysis."""
    from sweeps import analyze, provenance  # noqa: PLC0415

    for name in names:
        folder = HERE / "docs" / name
        committed = json.loads((folder / "analysis.json").read_text())
        n_boot = provenance.recorded_n_boot(committed) or 1000
        metric = committed["metric"]
        raw = analyze.load_results(folder)
        df, floor = analyze._successes(raw, metric), analyze.bayes_reference_of(raw, metric)
        seconds, dropped = 0.0, 0
        for _, g in df.groupby("family", sort=True):
            cells = analyze._cells(g)
            for fl in (None,) if floor is None else (None, floor):  # as sweeps.analyze
                t0 = time.process_time()
                got = analyze._loss_surface(cells, n_boot=n_boot, floor=fl)
                seconds += time.process_time() - t0
                if "_surface" in got:
                    dropped += got["_surface"].replicates_dropped
        print(json.dumps({"name": name, "seconds": seconds, "dropped": dropped}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", required="--child" not in sys.argv)
    ap.add_argument("--docs", nargs="+", default=["study_opt", "study_pilot", "study"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.docs)
    seconds: dict = collections.defaultdict(list)
    dropped: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(HERE), "archive", args.against], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        for r in range(args.rounds):
            for side, root in (("before", tmp), ("after", str(HERE))):
                cmd = [sys.executable, __file__, "--child", "--root", root, "--docs", *args.docs]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
                if out.returncode != 0:
                    sys.exit(f"{side} ({root}) failed:\n{out.stderr[-3000:]}")
                for line in out.stdout.splitlines():
                    row = json.loads(line)
                    seconds[(row["name"], side)].append(row["seconds"])
                    dropped[(row["name"], side)] = row["dropped"]
                    print(
                        f"  round {r}: {side:<6} {row['name']}: {row['seconds']:.1f} s", flush=True
                    )
    print(
        f"\n{args.against} (before) against this tree (after): CPU seconds of every family's "
        f"loss surfaces (free and fixed floor), median of {args.rounds} alternating runs; "
        "replicates dropped"
    )
    print("| analysis | before | after | before / after | dropped before / after |")
    print("|---|---:|---:|---:|---:|")
    for name in args.docs:
        b, a = (statistics.median(seconds[(name, s)]) for s in ("before", "after"))
        print(
            f"| {name} | {b:.1f} | {a:.1f} | {b / a:.2f}x | "
            f"{dropped[(name, 'before')]} / {dropped[(name, 'after')]} |"
        )


if __name__ == "__main__":
    main()
