"""Bad input: sparse ids outside their vocabulary (the id guard, every policy) and every
malformed-row class of the raw Criteo reader (strict error, lenient count)."""

from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from data.batch import PAD_ID, Batch, FeatureInfo, Schema
from data.builders import make_source
from data.config import CriteoConfig, DataConfig
from data.criteo import CRITEO_COLUMNS, CriteoFormatError, read_criteo
from data.id_guard import IdGuard, hash_ids
from data.sources import InMemorySource, RandomAccessSource
from tests.data.conftest import criteo_lines

REPO = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- id guard

# Feature "a": 5 rows, bags of up to 3 ids; feature "b": 1000 rows, one-hot. H = 3.
SCHEMA = Schema(
    dense_names=(),
    features=(
        FeatureInfo(name="a", vocab_size=5, max_hotness=3),
        FeatureInfo(name="b", vocab_size=1000, max_hotness=1),
    ),
)
# One record per example: ids [a0, a1, a2, b0] as int64, the dtype a reader of records on disk
# hands over before the cast to the int32 batch format.
GOOD = [[0, 4, PAD_ID, 999], [1, PAD_ID, PAD_ID, 0], [PAD_ID, PAD_ID, PAD_ID, 5]]
# Bad ids of each kind, for feature a (vocab 5): the vocab size itself, beyond it, negative
# other than the pad, beyond int32 (would wrap in an unchecked int32 cast), beyond int32 below.
BAD_IDS = {
    "vocab_size": 5,
    "beyond_vocab": 77,
    "negative": -2,
    "beyond_int32": 2**31 + 3,
    "huge": 2**40 + 5,  # 2**40 + 5 wraps to 5 (out of range) in int32
    "below_int32": -(2**31) - 9,
}


def _to_batch(records) -> Batch:
    n = len(records)
    ids = np.asarray(records, np.int64).reshape(n, 4)
    ids_bfh = np.full((n, 2, 3), PAD_ID, np.int64)
    ids_bfh[:, 0, :] = ids[:, :3]
    ids_bfh[:, 1, 0] = ids[:, 3]
    return Batch(
        dense_bn=np.zeros((n, 0), np.float32),
        ids_bfh=ids_bfh,
        labels_b=np.zeros(n, np.float32),
        weights_b=np.ones(n, np.float32),
    )


def _records(bad: int, at: int = 4) -> list[list[int]]:
    """8 records; record ``at`` holds ``bad`` in feature a, slot 1."""
    recs = [list(GOOD[i % 3]) for i in range(8)]
    recs[at] = [2, bad, PAD_ID, 7]
    return recs


def _source(records, policy: str, batch_size: int = 8) -> RandomAccessSource:
    return RandomAccessSource(
        SCHEMA,
        records,
        records,
        to_batch=_to_batch,
        batch_size=batch_size,
        eval_batch_size=4,
        seed=0,
        id_policy=policy,
    )


@pytest.mark.parametrize("kind", sorted(BAD_IDS))
def test_reject_names_feature_value_and_record(kind):
    bad = BAD_IDS[kind]
    src = _source(_records(bad), "reject")
    with pytest.raises(ValueError) as info:
        src.train_batch(0)
    msg = str(info.value)
    assert msg.startswith("train records: feature 'a' (index 0)"), msg
    assert f"has id {bad} at record 4 slot 1, outside [0, 5)" in msg, msg
    assert "data.id_policy" in msg
    # Rows held in memory are guarded when the source is built: the example is named.
    rows = _to_batch(_records(bad))
    with pytest.raises(ValueError, match=r"^training rows: feature 'a' .* at example 4 slot 1"):
        InMemorySource(SCHEMA, rows, _to_batch(GOOD), batch_size=4, eval_batch_size=3, seed=0)


@pytest.mark.parametrize("policy", ["modulo", "hash"])
def test_mapping_policies_map_into_range_and_count(policy):
    recs = _records(BAD_IDS["huge"], at=1)
    recs[6] = [-7, 3, 5, 1000]  # three more bad ids: a -7, a 5, b 1000
    src = _source(recs, policy)
    got = np.concatenate([src.train_batch(s).ids_bfh for s in range(3)])
    want_ids = _to_batch(recs).ids_bfh
    order = np.concatenate([np.asarray(src.train_indices[s]) for s in range(3)])
    want_ids = want_ids[order]
    bad = (want_ids < PAD_ID) | (want_ids >= np.array([5, 1000])[None, :, None])
    assert got.dtype == np.int32 and bad.sum() == 3 * 4  # every record drawn 3 times
    np.testing.assert_array_equal(got[~bad], want_ids[~bad])  # valid ids and pads untouched
    vocab = np.broadcast_to(np.array([5, 1000])[None, :, None], got.shape)[bad]
    if policy == "modulo":
        np.testing.assert_array_equal(got[bad], np.mod(want_ids[bad], vocab))
    else:
        feature = np.broadcast_to(np.arange(2)[None, :, None], got.shape)[bad]
        np.testing.assert_array_equal(got[bad], hash_ids(want_ids[bad], feature, vocab))
    assert ((got[bad] >= 0) & (got[bad] < vocab)).all()
    # Counted per feature, in the stats the trainer writes to data_stats.json.
    assert src.stats["ids"] == {"policy": policy, "mapped": {"a": 9, "b": 3}}
    json.dumps(src.stats)


def test_hash_spreads_ids_modulo_collides():
    ids = 5 + 1000 * np.arange(64, dtype=np.int64) * 2**30  # all equal mod 1000
    assert len(set(np.mod(ids, 1000).tolist())) == 1
    assert len(set(hash_ids(ids, 1, 1000).tolist())) > 50
    # Feature index salts the hash: the same bad id lands on unrelated rows per feature.
    assert (hash_ids(ids, 0, 10**6) != hash_ids(ids, 1, 10**6)).mean() > 0.95


_HASH_SCRIPT = """
import json, sys
import numpy as np
from data.batch import Batch
from data.id_guard import IdGuard
from tests.data.test_bad_input import SCHEMA, _to_batch
recs = json.loads(sys.argv[1])
out = {p: IdGuard(SCHEMA, p)(_to_batch(recs)).ids_bfh.tolist() for p in ("hash", "modulo")}
print(json.dumps(out))
"""


def test_mapping_is_identical_across_pythonhashseed():
    recs = [[2, b, PAD_ID, 7] for b in BAD_IDS.values()] + [[0, 1, 2, 10**12]]
    outs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run(
            [sys.executable, "-c", _HASH_SCRIPT, json.dumps(recs)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outs.append(json.loads(proc.stdout))
    here = {p: IdGuard(SCHEMA, p)(_to_batch(recs)).ids_bfh.tolist() for p in ("hash", "modulo")}
    assert outs[0] == outs[1] == here
    assert here["hash"] != here["modulo"]
    # Pinned: a changed hash would silently move every mapped id of a prepared run.
    assert [row[0][1] for row in here["hash"][:6]] == [
        hash_ids(np.int64(b), 0, 5).item() for b in BAD_IDS.values()
    ]


def test_no_bad_id_reaches_the_model_unnoticed():
    """Why the guard: inside jit an id == V pools as padding (silently dropped). Through the
    guard, every possible int64 id either raises or arrives in range, and each mapping counts."""
    import jax.numpy as jnp

    from recscale.kernels.embedding_bag.reference import pool

    table = jnp.arange(5 * 2, dtype=jnp.float32).reshape(5, 2) + 1.0
    unguarded = pool(table, jnp.asarray([[5, PAD_ID, PAD_ID]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(unguarded), [[0.0, 0.0]])  # the id vanished

    rng = np.random.default_rng(0)
    ids = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, (64, 4), dtype=np.int64)
    ids[:16] = rng.integers(-3, 1003, (16, 4))  # near the boundaries
    ids[:, 2] = np.where(rng.random(64) < 0.5, PAD_ID, ids[:, 2])
    batch = _to_batch(ids.tolist())
    n_bad = int(((batch.ids_bfh < PAD_ID) | (batch.ids_bfh >= np.array([5, 1000])[:, None])).sum())
    assert n_bad > 100
    with pytest.raises(ValueError, match="outside"):
        IdGuard(SCHEMA, "reject")(batch)
    for policy in ("modulo", "hash"):
        guard = IdGuard(SCHEMA, policy)
        out = guard(batch)
        a, b = out.ids_bfh[:, 0, :], out.ids_bfh[:, 1, :1]
        assert ((a == PAD_ID) | ((a >= 0) & (a < 5))).all()
        assert ((b == PAD_ID) | ((b >= 0) & (b < 1000))).all()
        assert sum(guard.stats["mapped"].values()) == n_bad
    # And the mapped id reads a real row: id 5 -> 0 under modulo pools row 0.
    mapped = IdGuard(SCHEMA, "modulo")(_to_batch([[5, PAD_ID, PAD_ID, 0]])).ids_bfh[:, 0, :]
    np.testing.assert_array_equal(np.asarray(pool(table, jnp.asarray(mapped))), [[1.0, 2.0]])


def test_format_errors_are_never_mapped():
    # A non-pad id in a slot beyond feature b's max_hotness breaks the format: no policy hides it.
    batch = _to_batch(GOOD)
    ids = batch.ids_bfh.copy()
    ids[0, 1, 2] = 3
    for policy in ("reject", "modulo", "hash"):
        with pytest.raises(ValueError, match="feature 'b' uses slots beyond its max_hotness"):
            IdGuard(SCHEMA, policy)(batch._replace(ids_bfh=ids))
    with pytest.raises(ValueError, match="expected .* of an integer dtype"):
        IdGuard(SCHEMA, "modulo")(batch._replace(ids_bfh=batch.ids_bfh.astype(np.float32)))
    with pytest.raises(ValueError, match="id policy must be one of"):
        IdGuard(SCHEMA, "clip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data.id_policy must be"):
        DataConfig(id_policy="clip")  # type: ignore[arg-type]


def test_first_mapping_per_feature_is_logged(caplog):
    guard = IdGuard(SCHEMA, "modulo")
    with caplog.at_level(logging.WARNING, logger="data.id_guard"):
        for step in range(3):
            guard(_to_batch(_records(9)), where=f"step {step}")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "step 0: feature 'a' has ids outside [0, 5); mapping them with "
        "id_policy='modulo' (counted in data stats under ids.mapped)"
    ]
    assert guard.stats["mapped"] == {"a": 3, "b": 0}


def test_make_source_guards_every_batch_with_the_config_policy(monkeypatch):
    cfg = DataConfig(batch_size=16, eval_batch_size=32, id_policy="hash")
    src = make_source(cfg)
    assert src.stats["ids"]["policy"] == "hash"
    src.train_batch(0)
    assert sum(src.stats["ids"]["mapped"].values()) == 0  # the generator's ids are all valid
    # A generator gone wrong (an id == vocab size) is caught at the source boundary.
    gen = src._gen
    real = gen.train_batch

    def broken(*a, **kw):
        b = real(*a, **kw)
        ids = b.ids_bfh.copy()
        ids[3, 2, 0] = cfg.synthetic.vocab_sizes[2]
        return b._replace(ids_bfh=ids)

    monkeypatch.setattr(gen, "train_batch", broken)
    assert (src.train_batch(1).ids_bfh < 1000).all()
    names = [f.name for f in src.schema.features]
    assert src.stats["ids"]["mapped"] == {**dict.fromkeys(names, 0), names[2]: 1}
    rejecting = make_source(DataConfig(batch_size=16, eval_batch_size=32))
    monkeypatch.setattr(rejecting._gen, "train_batch", broken)
    with pytest.raises(ValueError, match=r"^synthetic train step 1: feature .* has id 1000 at "):
        rejecting.train_batch(1)


# ----------------------------------------------------------------------------- Criteo rows

BAD_LINE = 7  # 1-based line of the malformed row


def _field(line: bytes, column: str, value: bytes) -> bytes:
    fields = line.split(b"\t")
    fields[CRITEO_COLUMNS.index(column)] = value
    return b"\t".join(fields)


def _tsv(lines: list[bytes], bad: bytes, *, eol: bytes = b"\n", prefix: bytes = b"") -> bytes:
    rows = [*lines[: BAD_LINE - 1], bad, *lines[BAD_LINE:]]
    return prefix + b"".join(r + eol for r in rows)


def _truncated(lines: list[bytes]) -> tuple[bytes, int]:
    data = gzip.compress(b"".join(r + b"\n" for r in lines * 20))
    cut = data[: len(data) * 2 // 3]
    complete = zlib.decompressobj(wbits=31).decompress(cut).count(b"\n")
    return cut, complete


def _bad_crc(lines: list[bytes]) -> bytes:
    data = bytearray(gzip.compress(b"".join(r + b"\n" for r in lines)))
    data[-8] ^= 0xFF  # the CRC32 in the trailer: every line decompresses, the check fails
    return bytes(data)


# Every malformed-row class. Each case: lines -> (file suffix, file bytes, line, column,
# reason, rows read). A BOM before line 1 and CRLF line ends are part of the format, so their
# cases put a bad row in such a file (line numbers, columns and values must be unaffected) or a
# BOM where it does not belong (mid-file, as after concatenating two files).
CriteoCase = Callable[[list[bytes]], tuple[str, bytes, int, str, str, int]]
CRITEO_CASES: dict[str, CriteoCase] = {
    "wrong_column_count": lambda g: (
        ".tsv",
        _tsv(g, g[0] + b"\t"),
        BAD_LINE,
        "(row)",
        "wrong column count",
        20,
    ),
    "empty_line": lambda g: (".tsv", _tsv(g, b""), BAD_LINE, "(row)", "wrong column count", 20),
    "trailing_empty_line": lambda g: (
        ".tsv",
        b"".join(r + b"\n" for r in g) + b"\n",
        21,
        "(row)",
        "wrong column count",
        21,
    ),
    "crlf_bad_hex": lambda g: (
        ".tsv",
        _tsv(g, _field(g[0], "C26", b"abcd123"), eol=b"\r\n"),
        BAD_LINE,
        "C26",
        "bad hex",
        20,
    ),
    "crlf_stray_cr": lambda g: (
        ".tsv",
        _tsv(g, _field(g[0], "C26", b"abcd1234") + b"\r", eol=b"\r\n"),
        BAD_LINE,
        "C26",
        "bad hex",
        20,
    ),
    "bom_then_bad_row": lambda g: (
        ".tsv.gz",
        gzip.compress(_tsv(g, _field(g[0], "I1", b"x"), prefix=b"\xef\xbb\xbf")),
        BAD_LINE,
        "I1",
        "non-integer",
        20,
    ),
    "bom_mid_file": lambda g: (
        ".tsv",
        _tsv(g, b"\xef\xbb\xbf" + g[0]),
        BAD_LINE,
        "label",
        "bad label",
        20,
    ),
    "bad_hex": lambda g: (
        ".tsv",
        _tsv(g, _field(g[0], "C3", b"0x12ab34")),
        BAD_LINE,
        "C3",
        "bad hex",
        20,
    ),
    "non_utf8_hex": lambda g: (
        ".tsv",
        _tsv(g, _field(g[0], "C9", b"\xff\xfe345678")),
        BAD_LINE,
        "C9",
        "bad hex",
        20,
    ),
    "non_integer": lambda g: (
        ".tsv",
        _tsv(g, _field(g[0], "I5", b"1e3")),
        BAD_LINE,
        "I5",
        "non-integer",
        20,
    ),
    "out_of_range_integer": lambda g: (
        ".tsv",
        _tsv(g, _field(g[0], "I13", b"-2147483649")),
        BAD_LINE,
        "I13",
        "out-of-range integer",
        20,
    ),
    "bad_label": lambda g: (
        ".tsv",
        _tsv(g, _field(g[0], "label", b"0.5")),
        BAD_LINE,
        "label",
        "bad label",
        20,
    ),
    "truncated_gzip": lambda g: (
        ".tsv.gz",
        _truncated(g)[0],
        _truncated(g)[1] + 1,
        "(file)",
        "truncated gzip",
        _truncated(g)[1] + 1,
    ),
    "corrupt_gzip_trailer": lambda g: (".tsv.gz", _bad_crc(g), 21, "(file)", "truncated gzip", 21),
    "not_gzip": lambda g: (
        ".tsv.gz",
        b"".join(r + b"\n" for r in g),
        1,
        "(file)",
        "truncated gzip",
        1,
    ),
}


@pytest.fixture(scope="module")
def good_rows() -> list[bytes]:
    return [line.encode() for line in criteo_lines(20, seed=3)]


@pytest.mark.parametrize("case", sorted(CRITEO_CASES))
def test_every_malformed_criteo_row_class(tmp_path, good_rows, case):
    suffix, data, line, column, reason, rows_read = CRITEO_CASES[case](good_rows)
    path = tmp_path / f"{case}{suffix}"
    path.write_bytes(data)
    # Strict: the first malformed row raises, naming file, line and column.
    with pytest.raises(CriteoFormatError) as info:
        read_criteo(path, CriteoConfig())
    err = info.value
    assert (err.path, err.line, err.column, err.reason) == (str(path), line, column, reason)
    assert f"{path}:{line}: column {column}: {reason}" in str(err)
    # Lenient: one counted reject, written out; reading goes on with the next file.
    after = tmp_path / "after.tsv"
    after.write_bytes(b"".join(r + b"\n" for r in good_rows[:3]))
    rejects = tmp_path / "rejects.tsv"
    lenient = CriteoConfig(strict=False, rejects_path=str(rejects))
    batch, stats = read_criteo([path, after], lenient)
    assert stats.rows_read == stats.rows_kept + stats.rows_rejected == rows_read + 3
    assert stats.rows_rejected == 1 and stats.rejects_by_reason == {reason: 1}
    assert batch.batch_size == stats.rows_kept
    stats.check()
    record = rejects.read_bytes().split(b"\n")[1].split(b"\t", 4)
    assert record[:4] == [str(path).encode(), str(line).encode(), reason.encode(), column.encode()]
