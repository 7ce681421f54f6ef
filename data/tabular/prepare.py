"""Streaming preparation of a tabular dataset into array_record shards, with bounded memory.

``python -m data.tabular.prepare SPEC [--root DIR] [--workers N]`` (or, on first use, the
trainer's ``--data.kind tabular``) reads the spec's files in two passes:

1. **count**: the training split's rows, for the vocabularies and numeric moments;
2. **encode**: every row to fixed-width records (label, weight, dense values, ids), written to
   ``array_record`` shards per split (``shards/<split>/f<file>-c<piece>-p<part>.array_record``,
   one record per example, read by random access through
   :class:`data.record_files.ArrayRecordFiles`, a grain data source).

Work is cut into *parts*: ``rows_per_shard`` consecutive rows of one file. Each finished part
leaves a marker (its counts, or its shards' row counts and reject tally), written after its
data by atomic rename, so a killed preparation resumes at the first unfinished part: a CSV is
re-parsed up to there but nothing is counted or written twice. Files go to ``workers`` processes
(each parses on a background thread while it encodes). Memory is bounded by the chunk size, the
side tables and the vocabularies, never by the data's size (hash huge vocabularies).

The output folder is ``<root>/<name>-<fingerprint>``; the fingerprint hashes the spec and every
input file's path, size and modification time, so a changed spec or file prepares afresh. A
folder is complete when it holds ``manifest.json``.

A prepared folder holds only data (JSON, Arrow files, array_record shards, TSV rejects): reading
one never runs code (counts are Arrow files, never pickles), never reads a shard outside
``shards/`` (the manifest's paths are checked), and a symbolic link planted in it never
redirects a write. What it holds is trusted otherwise: its vocabulary and records are used as
they are, so take prepared folders only from whoever you would take the data from.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa

from data.batch import Batch, FeatureInfo, Schema
from data.record_files import ArrayRecordFiles
from data.tabular import encode as enc
from data.tabular import parse, passes
from data.tabular.passes import (
    DEFAULT_ROOT,
    Inputs,
    atomic_write,
    exclusive,
    expand,
    interaction_columns,
    load_sides,
    record_dtype,
    resolve_inputs,
    work_units,
)
from data.tabular.read import (
    Reject,
    TabularFormatError,
    file_columns,
    iter_chunks,
)
from data.tabular.seq_prepare import prepare_sequences
from data.tabular.seq_spec import is_sequence_spec
from data.tabular.spec import TabularSpec, load_spec, spec_from_dict


def decode_records(records, dtype: np.dtype) -> Batch:
    """Records (bytes) -> a :class:`Batch` (one ``frombuffer`` over the joined bytes)."""
    arr = np.frombuffer(b"".join(records), dtype=dtype)
    return Batch(
        dense_bn=np.ascontiguousarray(arr["dense"]),
        ids_bfh=np.ascontiguousarray(arr["ids"]),
        labels_b=np.ascontiguousarray(arr["label"]),
        weights_b=np.ascontiguousarray(arr["weight"]),
    )


# ----------------------------------------------------------------------------- driver


@dataclasses.dataclass
class Prepared:
    """A prepared dataset: its folder, spec, schema, vocabulary and shards."""

    folder: str
    spec: TabularSpec
    schema: Schema
    vocab: enc.Vocabulary
    shards: dict[str, list[tuple[str, int]]]
    stats: dict[str, Any]

    @property
    def dtype(self) -> np.dtype:
        return record_dtype(self.schema)

    def records(self, split: str):
        """The split's records for random access (a grain data source over its shards)."""
        shards = [(p, n) for p, n in self.shards.get(split, []) if n]
        if not shards:
            raise ValueError(f"prepared dataset {self.folder} has no {split} rows")
        return ArrayRecordFiles([p for p, _ in shards], [n for _, n in shards])

    def to_batch(self, records) -> Batch:
        return decode_records(records, self.dtype)

    def encode_file(self, path: str, *, strict: bool | None = None) -> tuple[Batch, dict]:
        """Every row of a new file of this spec, encoded in memory with the prepared vocabulary
        (unseen ids go to the OOV bucket and are counted; the split rule is not applied)."""
        spec = self.spec
        strict = spec.strict if strict is None else strict
        sides = load_sides(spec, resolve_inputs(spec))
        cols = interaction_columns(spec, sides)
        encoder = enc.Encoder(spec, self.vocab)
        rejects: list[Reject] = []
        parts = []
        for chunk in iter_chunks(path, spec.format, cols, strict=strict, on_reject=rejects.append):
            parsed = parse.parse_chunk(
                spec,
                chunk,
                sides,
                file_split=parse.VALID,
                file_index=0,
                strict=strict,
                rejects=rejects,
            )
            parts.append(encoder.encode(parsed))
        if not parts or not sum(len(p[2]) for p in parts):
            reasons = dict(Counter(r.reason for r in rejects))
            raise TabularFormatError(f"{path}: no rows to evaluate (rejected: {reasons or 'none'})")
        dense, ids, labels, weights = (np.concatenate(a) for a in zip(*parts, strict=True))
        counts = encoder.stats()  # per split; every row of the file counts as "valid"
        stats = {
            "file": path,
            "rows": int(labels.size),
            "rejected": dict(Counter(r.reason for r in rejects)),
            "oov": {k: v["valid"] for k, v in counts["oov"].items() if v["valid"]},
            "missing": {k: v["valid"] for k, v in counts["missing"].items() if v["valid"]},
            "truncated_tokens": counts["truncated_tokens"],
        }
        return Batch(dense, ids, labels, weights), stats

    def serving_encoding(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The encoding as a serving artifact stores it (``data/tabular/serving.py``); reads
        the side tables again, and the first training file's column names (where it is gone,
        a request may carry only the columns the spec names)."""
        from data.tabular.serving import serving_encoding

        spec = self.spec
        sides = tuple(tuple(expand(spec, j.path, f"side table of {j.key!r}")) for j in spec.joins)
        try:
            columns = tuple(
                file_columns(expand(spec, spec.train[:1], "train file")[0], spec.format)
            )
        except (OSError, TabularFormatError):
            columns = ()
        return serving_encoding(spec, self.vocab, load_sides(spec, Inputs((), sides)), columns)

    @classmethod
    def load(cls, folder: str, spec: TabularSpec) -> Prepared:
        """A prepared folder's manifest, shard list and vocabulary, checked: a malformed one,
        a shard path outside ``shards/<split>/``, or tables other than the spec's are a
        one-line :class:`TabularFormatError` (prepare again), never a raw ``KeyError``."""
        path = os.path.join(folder, "manifest.json")
        try:
            with open(path) as fh:
                m = json.load(fh)
            schema = Schema(
                dense_names=tuple(m["schema"]["dense"]),
                features=tuple(FeatureInfo(**f) for f in m["schema"]["features"]),
            )
            shards = {s: [_shard(folder, s, p, n) for p, n in v] for s, v in m["shards"].items()}
            vocab = enc.Vocabulary.load(os.path.join(folder, "vocab"))
            if sorted(vocab.values) != sorted(spec.tables):
                raise ValueError(f"vocabulary tables {sorted(vocab.values)} are not the spec's")
            stats = dict(m["stats"])
        except (OSError, KeyError, TypeError, ValueError, pa.ArrowException) as e:
            raise TabularFormatError(
                f"{path}: not a prepared dataset of this version ({type(e).__name__}: "
                f"{str(e)[:200]}); delete {folder} and run prepare again"
            ) from None
        return cls(folder, spec, schema, vocab, shards, stats)


_SHARD_NAME = re.compile(r"f\d{5}-c\d{4}-p\d{6}\.array_record")


def _shard(folder: str, split: str, rel: str, rows: int) -> tuple[str, int]:
    """A manifest's shard entry as (path, rows): only ``shards/<split>/<part>.array_record``,
    so a crafted manifest cannot point the reader outside the folder."""
    parts = rel.split("/") if isinstance(rel, str) else []
    ok = (
        split in parse.SPLITS
        and len(parts) == 3
        and parts[:2] == ["shards", split]
        and _SHARD_NAME.fullmatch(parts[2])
    )
    if not ok or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"bad shard entry {[rel, rows]!r} of split {split!r}"[:200])
    return os.path.join(folder, rel), rows


def _counted(f) -> bool:
    if f.kind == "numeric":
        return f.standardize and not f.boundaries
    return not f.hash_buckets


def prepared_folder(spec: TabularSpec, root: str = "") -> tuple[str, Inputs]:
    inputs = resolve_inputs(spec)
    root = os.path.abspath(os.path.expanduser(root or DEFAULT_ROOT))
    return os.path.join(root, f"{spec.name}-{inputs.fingerprint(spec)[:16]}"), inputs


def prepare(
    spec: TabularSpec | str,
    root: str = "",
    *,
    workers: int = 0,
    progress: bool = True,
) -> Prepared:
    """Prepares ``spec``'s data under ``root`` (resuming a killed run), or loads it if done.

    Args:
      workers: processes (0 = one per input file, at most the CPU count).
      progress: show rich progress bars (rows and rows/s per pass).

    Raises:
      TabularFormatError: bad input (strict spec), naming file, line and column.
    """
    if isinstance(spec, str):
        spec = load_spec(spec)
    folder, inputs = prepared_folder(spec, root)
    if os.path.exists(os.path.join(folder, "manifest.json")):
        return Prepared.load(folder, spec)
    os.makedirs(folder, exist_ok=True)
    with exclusive(folder):  # two processes (e.g. a multi-process run's) prepare it once
        if os.path.exists(os.path.join(folder, "manifest.json")):
            return Prepared.load(folder, spec)
        _prepare_locked(spec, inputs, folder, workers, progress)
    return Prepared.load(folder, spec)


def _prepare_locked(
    spec: TabularSpec, inputs: Inputs, folder: str, workers: int, progress: bool
) -> None:
    for stale in glob.glob(os.path.join(folder, "shards", "*", "*.tmp*")):
        os.remove(stale)  # a killed run's unfinished shard (its part has no marker)
    for sub in ("count", "vocab", "parts", "rejects", *(f"shards/{s}" for s in parse.SPLITS)):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    saved = {"spec": spec.to_dict(), "base_dir": spec.base_dir}
    atomic_write(os.path.join(folder, "spec.json"), json.dumps(saved, indent=1).encode())
    # Side-table and column errors before any pass starts.
    interaction_columns(spec, load_sides(spec, inputs), inputs.files[0][0])
    t0 = time.perf_counter()
    units = work_units(spec, inputs)
    workers = workers or min(len(units), os.cpu_count() or 1)
    count_units = [
        u for u, (i, *_) in enumerate(units) if inputs.files[i][1] in (None, parse.TRAIN)
    ]
    if not os.path.exists(os.path.join(folder, "vocab", "scales.json")):
        # Hashed and bucketised features need no vocabulary, nor unscaled numerics moments:
        # a spec of only those (e.g. Criteo's) skips the counting pass.
        if any(_counted(f) for f in spec.features):
            _run("count", spec, inputs, folder, count_units, workers, progress)
        counts = enc.Counts()
        # Only this version's Arrow files are read: a pickle (``.pkl``, an older version's
        # counts, or one planted in a shared folder) is never opened; its part was counted again.
        for name in sorted(os.listdir(os.path.join(folder, "count"))):
            if name.endswith(passes.COUNTS_SUFFIX):
                try:
                    counts.merge(enc.Counts.load(os.path.join(folder, "count", name)))
                except ValueError as e:
                    raise TabularFormatError(
                        f"{e}; delete {folder} and run prepare again"
                    ) from None
        vocab = enc.Vocabulary.build(spec, counts)
        tmp = os.path.join(folder, "vocab.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        vocab.save(tmp)
        shutil.rmtree(os.path.join(folder, "vocab"))
        os.replace(tmp, os.path.join(folder, "vocab"))
    t1 = time.perf_counter()
    _run("encode", spec, inputs, folder, list(range(len(units))), workers, progress)
    t2 = time.perf_counter()
    _write_manifest(spec, inputs, folder, {"count_s": t1 - t0, "encode_s": t2 - t1})


_PASSES = {"count": passes.count_unit, "encode": passes.encode_unit}


def _run(label: str, spec, inputs, folder, indices, workers, progress) -> None:
    """Runs pass ``label`` over the files ``indices``: in this process for one worker, else in
    ``workers`` child interpreters (``python -m data.tabular.prepare --worker``: plain
    subprocesses, not multiprocessing, so no caller needs a ``__main__`` guard and a parent
    that holds jax threads is never forked), each reporting its rows on stdout."""
    import subprocess

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    fn = _PASSES[label]
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.completed:,.0f} rows"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task(f"{label} {len(indices)} file piece(s)", total=None, rate="")
        start = time.perf_counter()
        lock = threading.Lock()

        def advance(k: int) -> None:
            with lock:
                bar.advance(task, k)
                done = bar.tasks[0].completed
                rate = done / max(time.perf_counter() - start, 1e-9)
                bar.update(task, rate=f"{rate:,.0f} rows/s")

        if workers <= 1 or len(indices) <= 1:
            passes.report_rows_to(advance)
            try:
                for i in indices:
                    fn(spec, inputs, folder, i)
            finally:
                passes.report_rows_to(None)
            return
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        # Units dealt round-robin: one child per worker and pass (pieces are of similar size).
        todo = [indices[w::workers] for w in range(min(workers, len(indices)))]
        running: list[tuple[subprocess.Popen, list[threading.Thread], list[str], list[str]]] = []

        def watch(proc: subprocess.Popen) -> None:
            for line in proc.stdout:
                if line.startswith("rows "):
                    advance(int(line.split()[1]))

        def drain(proc: subprocess.Popen, err: list[str]) -> None:  # no child blocks on stderr
            err.extend(proc.stderr)

        try:
            while todo or running:
                while todo and len(running) < workers:
                    # Through data._child: a worker dies with this process, so a relaunch never
                    # races an orphan writing the same parts.
                    cmd = [
                        sys.executable,
                        "-m",
                        "data._child",
                        str(os.getpid()),
                        sys.executable,
                        "-m",
                        "data.tabular.prepare",
                        "--worker",
                        label,
                        "--folder",
                        folder,
                        "--units",
                        ",".join(map(str, todo.pop(0))),
                    ]
                    proc = subprocess.Popen(
                        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
                    )
                    err: list[str] = []
                    threads = [
                        threading.Thread(target=watch, args=(proc,), daemon=True),
                        threading.Thread(target=drain, args=(proc, err), daemon=True),
                    ]
                    for t in threads:
                        t.start()
                    running.append((proc, threads, cmd, err))
                proc, threads, cmd, err = running.pop(0)
                proc.wait()
                for t in threads:
                    t.join()
                proc.stdout.close()
                proc.stderr.close()
                err = "".join(err)
                if proc.returncode:
                    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
                    if lines and lines[-1].startswith("error: "):
                        raise TabularFormatError(lines[-1].removeprefix("error: "))
                    raise RuntimeError(f"preparation worker {' '.join(cmd)} failed: {err[-2000:]}")
        finally:
            for proc, threads, _, _ in running:
                proc.kill()
                proc.wait()
                for t in threads:
                    t.join()
                proc.stdout.close()
                proc.stderr.close()


def _worker(label: str, folder: str, units: list[int]) -> None:
    """A child of :func:`_run`: one pass over some units, rows reported on stdout."""
    with open(os.path.join(folder, "spec.json")) as fh:
        saved = json.load(fh)
    where = os.path.join(folder, "spec.json")
    spec = spec_from_dict(saved["spec"], where=where, base_dir=saved["base_dir"])
    passes.report_rows_to(lambda k: print(f"rows {k}", flush=True))
    inputs = resolve_inputs(spec)
    for unit in units:
        _PASSES[label](spec, inputs, folder, unit)


def _write_manifest(spec: TabularSpec, inputs: Inputs, folder: str, timing: dict) -> None:
    vocab = enc.Vocabulary.load(os.path.join(folder, "vocab"))
    schema = vocab.schema(spec)
    shards: dict[str, list] = {s: [] for s in parse.SPLITS}
    rejected: Counter = Counter()
    oov: dict = {}
    missing: dict = {}
    truncated: Counter = Counter()
    for name in sorted(os.listdir(os.path.join(folder, "parts"))):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(folder, "parts", name)) as fh:
            info = json.load(fh)
        stem = name[: -len(".json")]
        for split, rows in info["rows"].items():
            shards[split].append((os.path.join("shards", split, stem + ".array_record"), rows))
        rejected.update(info["rejected"])
        for key, into in (("oov", oov), ("missing", missing)):
            for feat, per in info["stats"][key].items():
                acc = into.setdefault(feat, Counter())
                acc.update(per)
        truncated.update(info["stats"]["truncated_tokens"])
    rows = {s: sum(n for _, n in v) for s, v in shards.items()}
    manifest = {
        "fingerprint": os.path.basename(folder),
        "files": [
            {"path": p, "split": None if s is None else parse.SPLITS[s]} for p, s in inputs.files
        ],
        "schema": {
            "dense": list(schema.dense_names),
            "features": [dataclasses.asdict(f) for f in schema.features],
        },
        "shards": shards,
        "stats": {
            "rows": rows,
            "rejected": dict(rejected),
            "rejects_dir": os.path.join(folder, "rejects") if rejected else None,
            "oov": {k: dict(v) for k, v in oov.items()},
            "missing": {k: dict(v) for k, v in missing.items()},
            "truncated_tokens": dict(truncated),
            "timing_s": timing,
        },
    }
    atomic_write(os.path.join(folder, "manifest.json"), json.dumps(manifest, indent=1).encode())


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m data.tabular.prepare", description=__doc__.split("\n")[0]
    )
    ap.add_argument("spec", nargs="?", help="feature spec (.yaml/.json/.toml)")
    ap.add_argument("--root", default="", help=f"prepared-data root (default {DEFAULT_ROOT})")
    ap.add_argument("--workers", type=int, default=0, help="processes (0 = one per file)")
    ap.add_argument("--worker", choices=sorted(_PASSES), help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--units", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        if args.worker:
            _worker(args.worker, args.folder, [int(u) for u in args.units.split(",")])
            return 0
        if not args.spec:
            ap.error("a spec file is required")
        if is_sequence_spec(args.spec):  # an event log: histories, in this process
            q = prepare_sequences(args.spec, args.root)
            print(q.summary())
            return 0
        p = prepare(args.spec, args.root, workers=args.workers)
    except (TabularFormatError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = p.stats
    print(f"prepared {p.folder}: rows {s['rows']}, rejected {s['rejected'] or 0}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
