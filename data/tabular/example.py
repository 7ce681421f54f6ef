"""``python -m data.tabular.example DIR``: a small shop's click log to try the tabular path on.

Writes the layout of most public recommendation datasets (MovieLens, Taobao, Amazon reviews):

* ``interactions.csv``: ``user_id, item_id, timestamp, rating`` (1 to 5), 200,000 rows;
* ``users.csv``: ``user_id, age, gender, occupation``; ``items.csv``: ``item_id, genres``
  (a ``|`` list), ``price``;
* ``new.csv``: 10,000 later interactions, about 5% of them by 150 users who never appear in
  ``interactions.csv`` (present in ``users.csv``), for ``evaluate --data-path``;
* ``events.csv``: an event log for the sequential families (:func:`make_events`):
  ``user_id, item_id, timestamp, action``, 400 users' histories of 3 to 60 events over 300
  items, written in time order but with a few late rows and some events in the same second.

:data:`SPEC` is a feature spec of them (both side tables joined, every feature kind), for the
tests and benchmarks that train on the example; ``data.tabular.inspect`` proposes one too.
:data:`SEQUENCE_SPEC` is a sequence spec of ``events.csv`` (``data/tabular/seq_spec.py``).

The ratings come from a planted model (a user-genre affinity, an age-by-price term, item
popularity and noise), so a model that reads the joined features beats the base rate. Nothing is
downloaded; the files are a pure function of ``--seed``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

GENRES = (
    "action",
    "comedy",
    "drama",
    "horror",
    "scifi",
    "romance",
    "kids",
    "docs",
    "music",
    "sport",
    "travel",
    "food",
)
OCCUPATIONS = ("student", "engineer", "artist", "doctor", "retired", "sales", "teacher", "other")


SPEC = """\
name: shop
train: [interactions.csv]
joins:
  - {path: users.csv, key: user_id}
  - {path: items.csv, key: item_id}
split: {kind: random, valid_fraction: 0.1, seed: 0}
label: {column: rating, threshold: 4}
features:
  - {name: user_id, kind: categorical}
  - {name: item_id, kind: categorical, parse: int, table: item}
  - {name: genres, kind: multi_categorical, separator: "|", max_hotness: 3}
  - {name: gender, kind: categorical, hash_buckets: 8}
  - {name: occupation, kind: categorical}
  - {name: age, kind: numeric, standardize: true}
  - {name: price, kind: numeric, log: true, standardize: true}
  - {name: age_band, column: age, kind: numeric, boundaries: [25, 35, 50]}
"""
"""The example's feature spec (a string vocabulary, a shared-name table, a bag, a hash, numeric
transforms and buckets over two side tables)."""


SEQUENCE_SPEC = """\
name: shop_events
train: [events.csv]
sequence:
  user: user_id
  item: item_id
  item_parse: int
  time: timestamp
  max_len: 50
  side:
    - {name: action, kind: categorical}
split: {kind: leave_one_out}
"""
"""The event log's sequence spec (SASRec's leave-one-out split, an action side column)."""

EVENT_ITEMS = 300
"""Items of ``events.csv`` (every one appears, so the prepared vocabulary has this many)."""


def _write(path: str, columns: dict) -> None:
    pacsv.write_csv(pa.table(columns), path)


def make(directory: str, *, seed: int = 0, rows: int = 200_000) -> None:
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    n_users, n_items, d = 3000, 1500, len(GENRES)
    age = rng.integers(16, 75, n_users)
    gender = rng.choice(["f", "m"], n_users)
    occupation = rng.choice(OCCUPATIONS, n_users)
    taste = rng.normal(size=(n_users, d)) + (age[:, None] < 30) * np.eye(d)[GENRES.index("scifi")]
    n_genres = rng.integers(1, 4, n_items)
    genre_sets = [rng.choice(d, k, replace=False) for k in n_genres]
    item_vec = np.zeros((n_items, d))
    for i, g in enumerate(genre_sets):
        item_vec[i, g] = 1.0 / np.sqrt(len(g))
    price = np.round(np.exp(rng.normal(2.5, 1.0, n_items)), 2)
    popularity = rng.normal(0, 0.5, n_items)

    def interactions(n: int, users: np.ndarray, t0: int) -> dict:
        item_rank = np.minimum(rng.zipf(1.3, n) - 1, n_items - 1)
        items = item_rank
        u = rng.choice(users, n)
        score = (
            np.einsum("nd,nd->n", taste[u], item_vec[items])
            + popularity[items]
            - 0.4 * np.log(price[items]) * (age[u] < 30)
            + rng.normal(0, 0.8, n)
        )
        rating = np.clip(np.digitize(score, np.quantile(score, [0.15, 0.35, 0.6, 0.8])) + 1, 1, 5)
        ts = t0 + np.sort(rng.integers(0, 86_400 * 60, n))
        return {
            "user_id": [f"u{x}" for x in u],
            "item_id": items,
            "timestamp": ts,
            "rating": rating,
        }

    known = np.arange(n_users - 150)
    _write(os.path.join(directory, "interactions.csv"), interactions(rows, known, 1_700_000_000))
    later = np.arange(n_users)  # the last 150 users (5%) appear only here
    new = interactions(10_000, later, 1_700_000_000 + 86_400 * 60)
    _write(os.path.join(directory, "new.csv"), new)
    _write(
        os.path.join(directory, "users.csv"),
        {
            "user_id": [f"u{x}" for x in range(n_users)],
            "age": age,
            "gender": gender,
            "occupation": occupation,
        },
    )
    _write(
        os.path.join(directory, "items.csv"),
        {
            "item_id": np.arange(n_items),
            "genres": ["|".join(GENRES[g] for g in gs) for gs in genre_sets],
            "price": price,
        },
    )


def make_events(directory: str, *, seed: int = 0, users: int = 400) -> None:
    """Writes ``events.csv``: each user's items follow a planted successor table half of the
    time (else a Zipf-popular item), so an order-aware model can learn; user ``k``'s first
    item is ``k mod 300`` (every item appears). Raw item ids are ``10000 + k`` (not the dense
    ids). Times are whole seconds on a coarse clock (some events of a user tie); 2% of the
    rows are written late (after rows with later times)."""
    if users < EVENT_ITEMS:
        raise ValueError(f"make_events: users must be >= {EVENT_ITEMS} (each item appears)")
    rng = np.random.default_rng(seed)
    successor = rng.permutation(EVENT_ITEMS)
    lengths = np.minimum(3 + rng.geometric(1 / 15, users), 60)
    rows_u, rows_i, rows_t, rows_a = [], [], [], []
    for u in range(users):
        item = u % EVENT_ITEMS
        t = 1_700_000_000 + int(rng.integers(0, 86_400 * 30))
        for k in range(lengths[u]):
            if k:
                follow = rng.random() < 0.5
                item = successor[item] if follow else min(rng.zipf(1.4) - 1, EVENT_ITEMS - 1)
                t += int(rng.choice([0, 60, 600, 3600], p=[0.1, 0.4, 0.3, 0.2]))
            rows_u.append(u)
            rows_i.append(item)
            rows_t.append(t)
            rows_a.append(rng.choice(["view", "cart", "buy"], p=[0.8, 0.15, 0.05]))
    t = np.asarray(rows_t)
    order = np.argsort(t, kind="stable")
    late = rng.random(order.size) < 0.02  # written a few hundred rows after their place
    pos = np.arange(order.size) + np.where(late, rng.integers(50, 500, order.size), 0)
    order = order[np.argsort(pos, kind="stable")]
    _write(
        os.path.join(directory, "events.csv"),
        {
            "user_id": [f"u{rows_u[i]}" for i in order],
            "item_id": 10_000 + np.asarray(rows_i)[order],
            "timestamp": t[order],
            "action": np.asarray(rows_a)[order],
        },
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m data.tabular.example", description=__doc__.split("\n")[0]
    )
    ap.add_argument("directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=200_000)
    args = ap.parse_args(argv)
    make(args.directory, seed=args.seed, rows=args.rows)
    make_events(args.directory, seed=args.seed)
    print(f"wrote interactions.csv, users.csv, items.csv, new.csv, events.csv to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
