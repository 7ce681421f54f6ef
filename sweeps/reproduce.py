"""``python -m sweeps.reproduce DIR``: regenerate a committed analysis into a temporary folder
with the settings it records and compare it with what is committed, under the rule below.

What holds (measured on the committed ``docs/`` analyses, issue 36):

- **Where it was made** (same CPU model, Python and ``LIBRARIES`` versions, as its
  ``produced_by`` records): bit for bit, ``analysis.json``, ``results.csv`` and every PNG. The
  analysis is deterministic: fixed bootstrap seeds (``provenance.BOOTSTRAP_SEED``); two
  regenerations on one host are byte-identical (tested).
- **Elsewhere** (another CPU model: numpy's SIMD loops and OpenBLAS pick kernels by instruction
  set, and their last bits differ): ``results.csv`` byte for byte (it is the results store
  flattened, no arithmetic); in ``analysis.json`` the same keys, list lengths, strings, booleans,
  integers and Nones (which family is best, which IsoFLOP vertices are interior, which cells lie
  inside their intervals, how many replicates converged), and every float within
  ``|x - y| <= ATOL + rtol·max(|x|, |y|)``: rtol ``SURFACE_RTOL`` for the loss surfaces
  (``loss_surface*``, ``surface_check``: the bootstrap refits, a batched Levenberg-Marquardt
  with scipy's ``least_squares`` finishing the rows it leaves moving, stop where their
  tolerances say, and a last-bit change in the data moves each of the thousand refits within
  them) and ``RTOL`` for everything else. The PNGs are compared by their pixel size only (a
  band drawn from the surface's replicates moves by a fraction of a pixel, which changes bytes).

Measured (2026-11-27, with a scipy refit per replicate), this AMD EPYC VM against the committed
files (same library versions, analyses made on other hosts): ``docs/study`` 657 of 1,269 floats
differ, the worst 3.9e-4 relative (an interval bound of FinalMLP's fixed-floor surface optimum
at 1e12; 2.9e-5 for a free-floor surface), and outside the surfaces 7.9e-8;
``docs/study_check`` 18 floats, at most 5.7e-8; the Frappe re-run 17, at most 3.1e-14 (an
IsoFLOP parabola's vertex); ``study_grid`` (with its 200 replicates), ``study_lr`` and
``study_frappe`` bit for bit. SURFACE_RTOL is 2.6x the worst surface difference seen and RTOL
13x the worst elsewhere; ATOL (far below any loss's last printed digit) covers interval bounds
near zero (the c of a power law, ~1e-11). Since the refits were batched (2026-11-28) every
committed analysis with results has been regenerated on this VM. ``docs/showcase`` (older code, no
results.jsonl) is checked by ``tests/sweeps/test_committed_analyses.py`` on the keys it has.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import tempfile
from pathlib import Path
from typing import Any

import tyro

from sweeps import analyze, provenance

SURFACE_RTOL = 1e-3
RTOL = 1e-6
ATOL = 1e-12


def _rtol(path: str) -> float:
    return SURFACE_RTOL if "loss_surface" in path or path.startswith("/surface_check") else RTOL


def compare(
    committed: Any, regenerated: Any, *, exact: bool = False, subset: bool = False, path: str = ""
) -> list[str]:
    """Where ``regenerated`` (a JSON value) breaks the rule against ``committed``: one line per
    difference, naming its path. ``exact``: floats must be equal too. ``subset``: keys the
    regeneration adds are allowed (an analysis written by older code that wrote fewer).
    A committed analysis without ``produced_by`` (written before it was recorded) is compared
    without it; with it, its settings must match and its host and versions are not compared."""
    if isinstance(committed, dict) and isinstance(regenerated, dict):
        committed, regenerated = dict(committed), dict(regenerated)
        if path == "":
            rec, got = committed.pop("produced_by", None), regenerated.pop("produced_by", None)
            if rec is not None:
                for k in ("n_boot", "bootstrap_seed", "surface_from"):
                    if rec.get(k) != (got or {}).get(k):
                        return [f"/produced_by/{k}: {rec.get(k)!r} != {(got or {}).get(k)!r}"]
        missing = sorted(set(committed) - set(regenerated))
        extra = [] if subset else sorted(set(regenerated) - set(committed))
        out = [f"{path}/{k}: missing" for k in missing] + [f"{path}/{k}: added" for k in extra]
        for k in committed.keys() & regenerated.keys():
            out += compare(
                committed[k], regenerated[k], exact=exact, subset=subset, path=f"{path}/{k}"
            )
        return out
    if isinstance(committed, list) and isinstance(regenerated, list):
        if len(committed) != len(regenerated):
            return [f"{path}: {len(committed)} entries, regenerated {len(regenerated)}"]
        out = []
        for i, (a, b) in enumerate(zip(committed, regenerated, strict=True)):
            out += compare(a, b, exact=exact, subset=subset, path=f"{path}[{i}]")
        return out
    if type(committed) is float and type(regenerated) is float:
        if committed == regenerated or (math.isnan(committed) and math.isnan(regenerated)):
            return []
        if not exact and math.isclose(committed, regenerated, rel_tol=_rtol(path), abs_tol=ATOL):
            return []
        return [f"{path}: {committed!r} != {regenerated!r}"]
    if type(committed) is not type(regenerated) or committed != regenerated:
        return [f"{path}: {committed!r} != {regenerated!r}"]
    return []


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, from its header."""
    head = path.read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path}: not a PNG")
    return struct.unpack(">II", head[16:24])


def regenerate(sweep_dir: str | Path, out: str | Path) -> dict[str, Any]:
    """``sweeps.analyze`` of ``sweep_dir`` into ``out`` with the settings its committed
    analysis.json records (bootstrap replicates, the surface check's reference sweep, a path
    relative to where it was run: run from the same folder). Returns the new analysis."""
    committed = json.loads((Path(sweep_dir) / "analysis.json").read_text())
    argv = [str(sweep_dir), "--out", str(out)]
    if (n_boot := provenance.recorded_n_boot(committed)) is not None:
        argv += ["--n-boot", str(n_boot)]
    if ref := committed.get("surface_check_reference"):
        argv += ["--surface-from", ref]
    return analyze.main(argv)


def check(sweep_dir: str | Path, out: str | Path) -> list[str]:
    """Regenerate ``sweep_dir``'s analysis into ``out`` and compare every committed output with
    the regenerated one under the rule (exact where the committed ``produced_by`` matches this
    host and these versions). Returns the differences, one line each; none: it reproduces."""
    root, out = Path(sweep_dir), Path(out)
    committed = json.loads((root / "analysis.json").read_text())
    exact = provenance.same_environment(committed.get("produced_by"))
    regenerate(root, out)
    problems = compare(committed, json.loads((out / "analysis.json").read_text()), exact=exact)
    if (root / "results.csv").read_bytes() != (out / "results.csv").read_bytes():
        problems.append("results.csv differs")
    made = {p.name for p in out.glob("*.png")}
    for png in sorted(root.glob("*.png")):
        if png.name not in made:
            problems.append(f"{png.name}: not regenerated")
        elif exact and png.read_bytes() != (out / png.name).read_bytes():
            problems.append(f"{png.name}: bytes differ")
        elif png_size(png) != png_size(out / png.name):
            problems.append(
                f"{png.name}: {png_size(png)} pixels, regenerated {png_size(out / png.name)}"
            )
    problems += [
        f"{name}: regenerated, not committed"
        for name in sorted(made - {p.name for p in root.glob("*.png")})
    ]
    return [f"{root}: {p}" for p in problems]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReproduceArgs:
    sweep_dir: tyro.conf.Positional[str]
    """A folder with a committed analysis (analysis.json and results.jsonl, e.g. docs/study)."""


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(ReproduceArgs, args=argv, prog="python -m sweeps.reproduce")
    root = Path(args.sweep_dir)
    for name in ("analysis.json", "results.jsonl"):
        if not (root / name).exists():
            raise SystemExit(f"{root}: no {name}")
    with tempfile.TemporaryDirectory() as tmp:
        problems = check(root, tmp)
    if problems:
        raise SystemExit("\n".join(problems))
    print(f"{root}: reproduces")


if __name__ == "__main__":
    main()
