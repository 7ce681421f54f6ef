"""Generated stand-ins for the real Frappe and Criteo files (CI has no ``../shared/data``).

The files follow the real layouts closely enough for every reader, tfds builder and source to
run on them: BARS ``Frappe_x1`` CSVs with global ids in the real per-field ranges, and raw
Criteo TSV rows with the sample's missing rates, negative ``I2`` values and repeated hex
categoricals. They are random, not real data. Tests that take ``frappe_dir`` /
``criteo_sample`` run on the real files when present; the fixtures here run without them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

FRAPPE_HEADER = "label,user,item,daytime,weekday,isweekend,homework,cost,weather,country,city"
# [lo, hi) global-id range of each field in the BARS Frappe_x1 files (5382 ids in all).
FRAPPE_RANGES = (
    (0, 957),
    (957, 5039),
    (5039, 5046),
    (5046, 5053),
    (5053, 5055),
    (5055, 5058),
    (5058, 5060),
    (5060, 5069),
    (5069, 5149),
    (5149, 5382),
)
# Values of each field a generated training file draws from (Zipf-weighted), as in the real
# file a few users and items make most rows.
_FRAPPE_POOL = (90, 300, 7, 7, 2, 3, 2, 9, 30, 60)

# Per column of the 1999-row Criteo sample: fraction of missing I1..I13 and C1..C26, and
# distinct C1..C26 values.
_I_MISSING = (0.44, 0, 0.22, 0.21, 0.05, 0.25, 0.05, 0, 0.05, 0.44, 0.05, 0.78, 0.21)
_C_MISSING = (
    0,
    0,
    0.03,
    0.03,
    0,
    0.13,
    0,
    0,
    0,
    0,
    0,
    0.03,
    0,
    0,
    0,
    0.03,
    0,
    0,
    0.48,
    0.48,
    0.03,
    0.82,
    0,
    0.03,
    0.48,
    0.48,
)
_C_DISTINCT = (
    79,
    252,
    1293,
    1043,
    30,
    7,
    1164,
    39,
    2,
    908,
    926,
    1239,
    824,
    20,
    819,
    1159,
    9,
    534,
    201,
    4,
    1204,
    7,
    12,
    729,
    33,
    554,
)


def _zipf_choice(rng: np.random.Generator, values: np.ndarray, n: int) -> np.ndarray:
    p = 1.0 / np.arange(1, len(values) + 1) ** 1.1
    return rng.choice(values, size=n, p=p / p.sum())


@dataclasses.dataclass(frozen=True)
class FakeFrappe:
    """``dir/train.csv`` and ``dir/valid.csv`` and their raw int64 tables ``[rows, 11]``."""

    dir: Path
    train: np.ndarray
    valid: np.ndarray
    unseen_rows: tuple[int, ...]
    """0-based valid rows planted with values absent from the training file."""


def write_frappe(directory: Path, *, n_train: int = 400, n_valid: int = 150, seed: int = 0):
    """Writes a Frappe manual dir; ``valid.csv`` holds 3 unseen users (2 distinct) in its first
    100 rows, an unseen item and an unseen city; its other values all occur in training."""
    rng = np.random.default_rng(seed)
    train = np.empty((n_train, 11), np.int64)
    train[:, 0] = rng.random(n_train) < 1 / 3  # the real files: 1 positive per 2 negatives
    for f, ((lo, hi), k) in enumerate(zip(FRAPPE_RANGES, _FRAPPE_POOL, strict=True)):
        pool = np.sort(rng.choice(np.arange(lo, hi), size=k, replace=False))
        train[:, 1 + f] = _zipf_choice(rng, rng.permutation(pool), n_train)
    valid = np.empty((n_valid, 11), np.int64)
    valid[:, 0] = rng.random(n_valid) < 1 / 3
    for f in range(10):
        valid[:, 1 + f] = rng.choice(np.unique(train[:, 1 + f]), size=n_valid)
    seen = [set(train[:, 1 + f].tolist()) for f in range(10)]

    def unseen(f: int, k: int) -> list[int]:
        lo, hi = FRAPPE_RANGES[f]
        return [v for v in range(hi - 1, lo, -1) if v not in seen[f]][:k]

    u1, u2 = unseen(0, 2)
    (item,), (city,) = unseen(1, 1), unseen(9, 1)
    planted = {(7, 1): u1, (41, 1): u2, (88, 1): u1, (60, 2): item, (130, 10): city}
    for (row, col), value in planted.items():
        valid[row, col] = value
    directory.mkdir(parents=True, exist_ok=True)
    for name, table in (("train.csv", train), ("valid.csv", valid)):
        lines = [FRAPPE_HEADER, *(",".join(map(str, r)) for r in table.tolist())]
        (directory / name).write_text("\n".join(lines) + "\n")
    rows = tuple(sorted({r for r, _ in planted}))
    return FakeFrappe(dir=directory, train=train, valid=valid, unseen_rows=rows)


def criteo_lines(n: int, *, seed: int = 0) -> list[str]:
    """``n`` raw Criteo rows (no newline): label, I1..I13 (some empty, ``I2`` partly
    negative), C1..C26 (lowercase 8-hex-digit values drawn from per-column pools, some empty).
    """
    rng = np.random.default_rng(seed)
    cols: list[list[str]] = [(rng.random(n) < 0.21).astype(int).astype(str).tolist()]
    for j, missing in enumerate(_I_MISSING):
        x = np.floor(np.exp(rng.normal(1.5 + 0.3 * j, 1.6, n))).astype(np.int64)  # >= 0
        if j == 1:  # I2: about 11% of the sample is -1..-3
            x = np.where(rng.random(n) < 0.11, -rng.integers(1, 4, n), x)
        x = np.minimum(x, 2**31 - 1).astype(str)
        cols.append(np.where(rng.random(n) < missing, "", x).tolist())
    for missing, distinct in zip(_C_MISSING, _C_DISTINCT, strict=True):
        pool = rng.choice(2**32, size=distinct + distinct // 2 + 1, replace=False)
        hexes = np.asarray([f"{int(v):08x}" for v in _zipf_choice(rng, pool, n)])
        cols.append(np.where(rng.random(n) < missing, "", hexes).tolist())
    return ["\t".join(row) for row in zip(*cols, strict=True)]


@pytest.fixture(scope="session")
def generated_frappe(tmp_path_factory) -> FakeFrappe:
    """A generated Frappe manual dir: 400 training rows, 150 validation rows."""
    return write_frappe(tmp_path_factory.mktemp("generated_frappe"))


@pytest.fixture(scope="session")
def generated_criteo(tmp_path_factory) -> Path:
    """A generated 1999-row raw Criteo TSV, shaped like ``criteo_sample``."""
    path = tmp_path_factory.mktemp("generated_criteo") / "train_head1999.tsv"
    path.write_text("".join(line + "\n" for line in criteo_lines(1999)))
    return path


@dataclasses.dataclass(frozen=True)
class DataFiles:
    kind: str
    """``generated`` (always available) or ``real`` (``../shared/data``; skips when absent)."""
    path: Path
    """Frappe: the folder of ``train.csv`` and ``valid.csv``; Criteo: a 1999-row raw TSV."""


@pytest.fixture(scope="session", params=["generated", "real"])
def frappe_files(request) -> DataFiles:
    """Frappe files, generated or real: tests using this run on both."""
    if request.param == "real":
        return DataFiles("real", request.getfixturevalue("frappe_dir"))
    return DataFiles("generated", request.getfixturevalue("generated_frappe").dir)


@pytest.fixture(scope="session", params=["generated", "real"])
def criteo_files(request) -> DataFiles:
    """A 1999-row Criteo TSV, generated or the real sample: tests using this run on both."""
    if request.param == "real":
        return DataFiles("real", request.getfixturevalue("criteo_sample"))
    return DataFiles("generated", request.getfixturevalue("generated_criteo"))
