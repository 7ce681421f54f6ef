"""Raw Criteo reader: real rows, hashing, transform, every bad-input class, gzip, tfds builder."""

from __future__ import annotations

import gzip
import hashlib
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from data.config import CriteoConfig
from data.criteo import (
    CRITEO_COLUMNS,
    CriteoFormatError,
    ReadStats,
    count_criteo_rows,
    criteo_schema,
    hash_categorical,
    iter_criteo_chunks,
    read_criteo,
    transform_dense,
)

REPO = Path(__file__).resolve().parents[2]
CFG = CriteoConfig()
BAD_LINE_NO = 7  # 1-based line of the malformed row in the bad-input files


# ----------------------------------------------------------------------------- helpers


def _sample_lines(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return data[:-1].split(b"\n")


def _synthetic_lines(n: int, seed: int = 0) -> list[bytes]:
    """Valid raw rows (not real data): random labels, ints (some missing/negative), hex."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cols = [str(rng.integers(0, 2))]
        for _ in range(13):
            r = rng.random()
            cols.append("" if r < 0.2 else str(int(rng.integers(-3, 5000))))
        for _ in range(26):
            cols.append("" if rng.random() < 0.1 else f"{int(rng.integers(0, 2**32)):08x}")
        out.append("\t".join(cols).encode())
    return out


def _write(path: Path, lines: list[bytes], *, eol: bytes = b"\n", prefix: bytes = b"") -> Path:
    data = prefix + b"".join(line + eol for line in lines)
    if path.suffix == ".gz":
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def _with_field(line: bytes, column: str, value: bytes) -> bytes:
    fields = line.split(b"\t")
    fields[CRITEO_COLUMNS.index(column)] = value
    return b"\t".join(fields)


def _assert_batches_equal(a, b) -> None:
    for name, x, y in zip(a._fields, a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def _py_fmix64(z: int) -> int:
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _py_hash(hex_value: str, feature: int, vocab: int, seed: int) -> int:
    """The documented hash, written independently with Python ints."""
    if not hex_value or vocab == 1:
        return 0
    m = (1 << 64) - 1
    s = _py_fmix64((seed + 0x9E3779B97F4A7C15) & m)
    key = (feature << 32) | int(hex_value, 16)
    return 1 + _py_fmix64((key + s) & m) % (vocab - 1)


# ----------------------------------------------------------------------------- real rows


@pytest.fixture(scope="module")
def sample(criteo_sample):
    batch, stats = read_criteo(criteo_sample, CFG)
    fields = [line.decode().split("\t") for line in _sample_lines(criteo_sample)]
    return batch, stats, fields


def test_sample_all_rows_kept_in_strict_mode(sample):
    batch, stats, _ = sample
    assert (stats.rows_read, stats.rows_kept, stats.rows_rejected) == (1999, 1999, 0)
    assert stats.rejects_by_reason == {}
    stats.check()
    criteo_schema(CFG.vocab_sizes).validate(batch, where="criteo sample")
    assert batch.dense_bn.shape == (1999, 13) and batch.ids_bfh.shape == (1999, 26, 1)
    assert int(batch.labels_b.sum()) == 418
    assert batch.labels_b.mean(dtype=np.float64) == pytest.approx(418 / 1999, abs=1e-12)
    assert np.all(batch.weights_b == 1.0)
    vocab = np.asarray(CFG.vocab_sizes)
    assert np.all(batch.ids_bfh[:, :, 0] >= 0) and np.all(batch.ids_bfh[:, :, 0] < vocab)


def test_sample_categoricals_match_documented_hash(sample):
    batch, _, fields = sample
    cats = [row[14:] for row in fields]
    missing = np.array([[v == "" for v in row] for row in cats])
    assert missing.any(), "the sample has empty categoricals"
    ids = batch.ids_bfh[:, :, 0]
    np.testing.assert_array_equal(ids == 0, missing)  # bucket 0 iff missing
    for r in (0, 1, 500, 1998):
        want = [_py_hash(v, f, CFG.vocab_sizes[f], CFG.hash_seed) for f, v in enumerate(cats[r])]
        assert ids[r].tolist() == want


def test_sample_integers_transformed_as_documented(sample):
    batch, _, fields = sample
    raw = [[v for v in row[1:14]] for row in fields]
    negatives = [
        (r, c) for r, row in enumerate(raw) for c, v in enumerate(row) if v.startswith("-")
    ]
    assert negatives, "the sample has negative integers"
    r, c = negatives[0]
    x = int(raw[r][c])
    assert x < 0
    assert batch.dense_bn[r, c] == np.float32(-math.log1p(-x)) < 0  # sign kept, not clipped
    # Every value: missing -> 0; x >= 0 -> log(x + 1), as facebookresearch/dlrm.
    for r, row in enumerate(raw):
        for c, v in enumerate(row):
            x = int(v) if v else 0
            want = math.copysign(math.log1p(abs(x)), x) if x else 0.0
            assert batch.dense_bn[r, c] == np.float32(want), (r, c, v)


def test_hash_is_independent_of_pythonhashseed(criteo_sample, sample):
    code = (
        "import hashlib, sys; from data.config import CriteoConfig; "
        "from data.criteo import read_criteo; "
        "b, _ = read_criteo(sys.argv[1], CriteoConfig()); "
        "print(hashlib.sha256(b.ids_bfh.tobytes()).hexdigest())"
    )
    digests = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO))
        out = subprocess.run(
            [sys.executable, "-c", code, str(criteo_sample)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        digests.append(out.stdout.strip())
    here = hashlib.sha256(sample[0].ids_bfh.tobytes()).hexdigest()
    assert digests == [here, here]


def test_chunked_stream_equals_whole_read(criteo_sample, sample):
    stats = ReadStats()
    chunks = list(iter_criteo_chunks(str(criteo_sample), CFG, chunk_rows=300, stats=stats))
    assert [c.batch_size for c in chunks] == [300] * 6 + [199]
    joined = type(chunks[0])(*(np.concatenate(p) for p in zip(*chunks, strict=True)))
    _assert_batches_equal(joined, sample[0])
    assert stats.rows_read == stats.rows_kept == 1999


def test_crlf_bom_and_gzip_give_the_same_rows(criteo_sample, sample, tmp_path):
    lines = _sample_lines(criteo_sample)
    for path, kw in [
        (tmp_path / "crlf.tsv", {"eol": b"\r\n"}),
        (tmp_path / "bom.tsv", {"prefix": b"\xef\xbb\xbf"}),
        (tmp_path / "bom_crlf.tsv.gz", {"eol": b"\r\n", "prefix": b"\xef\xbb\xbf"}),
        (tmp_path / "plain.tsv.gz", {}),
    ]:
        batch, stats = read_criteo(_write(path, lines, **kw), CFG)
        assert stats.rows_kept == 1999 and stats.rows_rejected == 0, path.name
        _assert_batches_equal(batch, sample[0])
    # Without the final newline the last row still counts.
    path = tmp_path / "no_final_newline.tsv"
    path.write_bytes(b"\n".join(lines))
    _assert_batches_equal(read_criteo(path, CFG)[0], sample[0])


# ----------------------------------------------------------------------------- hashing, transform


def test_hash_categorical_properties():
    values = ["68fd1e64", "", "FFFFFFFF", "00000000", "deadBEEF"]
    ids = hash_categorical(values, 0, 1460, 0)
    assert ids.dtype == np.int32
    assert ids.tolist() == [_py_hash(v, 0, 1460, 0) for v in values]
    # Pinned values: changing the hash silently would invalidate every prepared dataset.
    assert ids.tolist()[:4] == [612, 0, 112, 166]
    assert hash_categorical(["68fd1e64"], 25, 10**7, 12345).tolist() == [7751946]
    assert hash_categorical(["deadbeef"], 3, 100, 0) == hash_categorical(["DEADBEEF"], 3, 100, 0)
    u32 = np.array([0x68FD1E64, 0xFFFFFFFF], np.uint32)
    assert hash_categorical(u32, 0, 1460, 0).tolist() == [612, 112]
    assert hash_categorical(values, 0, 1, 0).tolist() == [0] * 5  # vocab 1: all in bucket 0
    many = hash_categorical(np.arange(20000, dtype=np.uint32), 2, 50, 0)
    assert many.min() == 1 and many.max() == 49  # [1, vocab) all reached, never 0
    assert (
        hash_categorical(np.arange(1000, dtype=np.uint32), 0, 10**6, 1)
        != hash_categorical(np.arange(1000, dtype=np.uint32), 0, 10**6, 2)
    ).mean() > 0.99
    assert (
        hash_categorical(np.arange(1000, dtype=np.uint32), 0, 10**6, 0)
        != hash_categorical(np.arange(1000, dtype=np.uint32), 1, 10**6, 0)
    ).mean() > 0.99
    with pytest.raises(ValueError, match="bad hex 'xyz'"):
        hash_categorical(["12345678", "xyz"], 0, 10, 0)


def test_transform_dense_signed_log1p():
    raw = np.array([[0, 1, -1, 2147483647, -2147483648, 5]], np.int64)
    missing = np.array([[True, False, False, False, False, True]])
    out = transform_dense(raw, missing)
    assert out.dtype == np.float32
    want = [0.0, math.log(2), -math.log(2), math.log1p(2**31 - 1), -math.log1p(2**31), 0.0]
    np.testing.assert_array_equal(out[0], np.float32(want))


# ----------------------------------------------------------------------------- bad input

BAD_CASES = {
    # name: (make the bad line from a good one, reason, column, value shown in the error)
    "wrong_column_count": (
        lambda x: x.rsplit(b"\t", 1)[0],
        "wrong column count",
        "(row)",
        "39 columns",
    ),
    "too_many_columns": (lambda x: x + b"\t", "wrong column count", "(row)", "41 columns"),
    "empty_line": (lambda x: b"", "wrong column count", "(row)", "1 columns"),
    "bad_hex": (lambda x: _with_field(x, "C3", b"zz12ab34"), "bad hex", "C3", "'zz12ab34'"),
    "short_hex": (lambda x: _with_field(x, "C26", b"abc"), "bad hex", "C26", "'abc'"),
    "non_integer": (lambda x: _with_field(x, "I5", b"1.5"), "non-integer", "I5", "'1.5'"),
    "lone_minus": (lambda x: _with_field(x, "I1", b"-"), "non-integer", "I1", "'-'"),
    "out_of_range": (
        lambda x: _with_field(x, "I13", b"2147483648"),
        "out-of-range integer",
        "I13",
        "'2147483648'",
    ),
    "huge_integer": (
        lambda x: _with_field(x, "I2", b"-99999999999999999999999"),
        "out-of-range integer",
        "I2",
        "'-99999999999999999999999'",
    ),
    "bad_label": (lambda x: _with_field(x, "label", b"2"), "bad label", "label", "'2'"),
    "empty_label": (lambda x: _with_field(x, "label", b""), "bad label", "label", "''"),
}


@pytest.fixture(scope="module")
def good_lines() -> list[bytes]:
    return _synthetic_lines(20)


def _bad_file(tmp_path: Path, good: list[bytes], case: str, suffix: str = ".tsv"):
    make, reason, column, shown = BAD_CASES[case]
    bad = make(good[BAD_LINE_NO - 1])
    lines = [*good[: BAD_LINE_NO - 1], bad, *good[BAD_LINE_NO:]]
    return _write(tmp_path / f"{case}{suffix}", lines), bad, reason, column, shown


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_row_strict_names_file_line_column(tmp_path, good_lines, case):
    path, _, reason, column, shown = _bad_file(tmp_path, good_lines, case)
    with pytest.raises(CriteoFormatError) as info:
        read_criteo(path, CFG)
    msg = str(info.value)
    assert f"{path}:{BAD_LINE_NO}:" in msg and f"column {column}" in msg, msg
    assert reason in msg and shown in msg, msg
    err = info.value
    assert (err.path, err.line, err.column, err.reason) == (str(path), BAD_LINE_NO, column, reason)


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_row_lenient_rejects_and_counts(tmp_path, good_lines, case):
    path, bad, reason, column, _ = _bad_file(tmp_path, good_lines, case)
    rejects = tmp_path / "rejects.tsv"
    batch, stats = read_criteo(path, CriteoConfig(strict=False), rejects_path=str(rejects))
    n = len(good_lines)
    assert (stats.rows_read, stats.rows_kept, stats.rows_rejected) == (n, n - 1, 1)
    assert stats.rejects_by_reason == {reason: 1}
    stats.check()
    assert reason in stats.report() and rejects.name in stats.report()
    header, record, end = rejects.read_bytes().split(b"\n")
    assert header == b"file\tline\treason\tcolumn\trow" and end == b""
    assert record.split(b"\t", 4) == [
        str(path).encode(),
        b"7",
        reason.encode(),
        column.encode(),
        bad,
    ]
    # The kept rows are exactly the good ones.
    others = good_lines[: BAD_LINE_NO - 1] + good_lines[BAD_LINE_NO:]
    _assert_batches_equal(batch, read_criteo(_write(tmp_path / "good.tsv", others), CFG)[0])


def test_lenient_counts_several_reasons_across_files(tmp_path, good_lines):
    a = _write(
        tmp_path / "a.tsv", [b"", good_lines[0], _with_field(good_lines[1], "C1", b"g0000000")]
    )
    b = _write(
        tmp_path / "b.tsv.gz", [_with_field(good_lines[2], "I3", b"1e3"), b"", good_lines[3]]
    )
    stats = ReadStats()
    cfg = CriteoConfig(strict=False, rejects_path=str(tmp_path / "rej.tsv"))
    kept = sum(x.batch_size for x in iter_criteo_chunks([a, b], cfg, stats=stats))
    assert kept == stats.rows_kept == 2 and stats.rows_read == 6 and stats.rows_rejected == 4
    assert stats.rejects_by_reason == {"wrong column count": 2, "bad hex": 1, "non-integer": 1}
    assert stats.files == [str(a), str(b)]
    stats.check()
    records = [
        r.split(b"\t", 4)[:3] for r in (tmp_path / "rej.tsv").read_bytes().split(b"\n")[1:-1]
    ]
    assert records == [
        [str(a).encode(), b"1", b"wrong column count"],
        [str(a).encode(), b"3", b"bad hex"],
        [str(b).encode(), b"1", b"non-integer"],
        [str(b).encode(), b"2", b"wrong column count"],
    ]


def test_lenient_needs_a_rejects_file(tmp_path, good_lines):
    path = _write(tmp_path / "x.tsv", good_lines)
    with pytest.raises(ValueError, match="rejects"):
        read_criteo(path, CriteoConfig(strict=False))
    # The argument overrides the config's path.
    cfg = CriteoConfig(strict=False, rejects_path=str(tmp_path / "from_cfg.tsv"))
    read_criteo(path, cfg, rejects_path=str(tmp_path / "from_arg.tsv"))
    assert (tmp_path / "from_arg.tsv").is_file() and not (tmp_path / "from_cfg.tsv").exists()


def test_read_stats_check_catches_inconsistency():
    ReadStats(rows_read=3, rows_kept=2, rows_rejected=1, rejects_by_reason={"bad hex": 1}).check()
    with pytest.raises(AssertionError, match="rows_read 3"):
        ReadStats(rows_read=3, rows_kept=2).check()


def test_integer_edge_values_are_accepted(tmp_path, good_lines):
    values = [b"-2147483648", b"2147483647", b"-0", b"000000000000005", b"0"]
    lines = [_with_field(good_lines[0], "I4", v) for v in values]
    batch, _ = read_criteo(_write(tmp_path / "edge.tsv", lines), CFG)
    want = transform_dense(np.array([-(2**31), 2**31 - 1, 0, 5, 0], np.int64))
    np.testing.assert_array_equal(batch.dense_bn[:, 3], want)


def test_max_rows_caps_each_file(tmp_path, good_lines):
    a = _write(tmp_path / "a.tsv", good_lines)
    b = _write(tmp_path / "b.tsv.gz", good_lines)
    cfg = CriteoConfig(max_rows=5)
    batch, stats = read_criteo([a, b], cfg)
    assert batch.batch_size == stats.rows_read == 10 == count_criteo_rows([a, b], cfg)
    full, _ = read_criteo(a, CFG)
    np.testing.assert_array_equal(batch.ids_bfh[5:], full.ids_bfh[:5])


@pytest.fixture()
def truncated_gz(tmp_path, good_lines):
    lines = _synthetic_lines(400, seed=1)
    data = gzip.compress(b"".join(line + b"\n" for line in lines))
    path = tmp_path / "cut.tsv.gz"
    path.write_bytes(data[: len(data) * 2 // 3])
    partial = zlib.decompressobj(wbits=31).decompress(path.read_bytes())
    complete = partial.count(b"\n")
    assert 0 < complete < len(lines)
    return path, lines, complete, partial[partial.rfind(b"\n") + 1 :]


def test_truncated_gzip_strict_names_last_good_line(truncated_gz):
    path, _, complete, _ = truncated_gz
    with pytest.raises(CriteoFormatError, match="truncated gzip") as info:
        read_criteo(path, CFG)
    assert f"{path}:{complete + 1}:" in str(info.value)
    assert f"after line {complete}, the last good line" in str(info.value)


def test_truncated_gzip_lenient_counts_one_reject_and_stops(truncated_gz, tmp_path):
    path, lines, complete, fragment = truncated_gz
    rejects = tmp_path / "rej.tsv"
    batch, stats = read_criteo(path, CriteoConfig(strict=False), rejects_path=str(rejects))
    assert stats.rows_kept == complete and stats.rows_rejected == 1
    assert stats.rows_read == complete + 1 == count_criteo_rows(path, CFG)
    assert stats.rejects_by_reason == {"truncated gzip": 1}
    record = rejects.read_bytes().split(b"\n")[1]
    assert record.split(b"\t", 4) == [
        str(path).encode(),
        str(complete + 1).encode(),
        b"truncated gzip",
        b"(file)",
        fragment,
    ]
    whole = read_criteo(_write(tmp_path / "head.tsv", lines[:complete]), CFG)[0]
    _assert_batches_equal(batch, whole)


# ----------------------------------------------------------------------------- tfds builder


def test_tfds_builder_matches_reader_without_tensorflow(criteo_files, tmp_path):
    # Preparing and reading array_record must not import TensorFlow (the project does not
    # depend on it). Blocking the import is not an option: etils and tfds probe for it.
    tf_loaded_before = "tensorflow" in sys.modules
    from data.tfds_builders.criteo import CriteoRawConfig, load_criteo_tfds, records_to_batch

    lines = _sample_lines(criteo_files.path)
    whole, _ = read_criteo(criteo_files.path, CFG)
    manual = tmp_path / "manual"
    manual.mkdir()
    _write(manual / "train.txt", lines)
    (manual / "notes.md").write_text("not matched by any pattern")
    data_dir = tmp_path / "tfds"
    train = load_criteo_tfds(data_dir, manual, "train")  # kaggle config: last 1/7 = validation
    valid = load_criteo_tfds(data_dir, None, "validation")  # already prepared
    assert (len(train), len(valid)) == (1999 - 1999 // 7, 1999 // 7)
    got = records_to_batch(
        [*(train[i] for i in range(len(train))), *(valid[i] for i in range(len(valid)))]
    )
    _assert_batches_equal(got, whole)

    # File-based validation split and natural file order (day_2 before day_10).
    _write(manual / "day_2", lines[:300])
    _write(manual / "day_10.gz", lines[300:700])
    _write(manual / "day_11", lines[700:900])
    cfg = CriteoRawConfig(
        name="days", train_patterns=("day_*",), validation_patterns=("day_11",), hash_seed=3
    )
    train = load_criteo_tfds(data_dir, manual, "train", config=cfg)
    valid = load_criteo_tfds(data_dir, manual, "validation", config=cfg)
    reader_cfg = CriteoConfig(hash_seed=3)
    want_train, _ = read_criteo([manual / "day_2", manual / "day_10.gz"], reader_cfg)
    want_valid, _ = read_criteo(manual / "day_11", reader_cfg)
    _assert_batches_equal(records_to_batch(train[i] for i in range(len(train))), want_train)
    _assert_batches_equal(records_to_batch(valid[i] for i in range(len(valid))), want_valid)
    assert tf_loaded_before or "tensorflow" not in sys.modules
