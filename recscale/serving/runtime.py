"""Load and run a recscale serving artifact with only jax and flatbuffers (issue 20).

This file is copied into every artifact as ``recscale_model.py`` (and its raw-row encoder,
``rows.py``, as ``recscale_rows.py`` beside it); neither imports anything from recscale, so a machine with ``pip install jax flatbuffers`` (jax brings jaxlib and numpy;
``jax.export`` reads the compiled forward pass with flatbuffers, which jax does not install)
runs an exported model without the project (Parquet input files also need pyarrow)::

    from recscale_model import Model          # or: from recscale.serving.runtime import Model
    model = Model.load("MODEL")
    p = model.predict(dense_bn, ids_bfh)      # float32 [B] probabilities

Inputs: ``dense_bn`` float32 ``[B, N]`` in the order of ``manifest["inputs"]["dense"]``;
``ids_bfh`` int ``[B, F, H]`` per feature of ``manifest["inputs"]["features"]``, bags padded with
-1 (``H`` up to the artifact's ``max_hotness``; shorter bags are padded). An id outside its
feature's vocabulary is treated as a missing id (padding) and counted in
``Model.counters["out_of_vocab_ids"]``; nothing else is changed silently. Batches are padded to
the next power of two, so a server's varying batch sizes compile a handful of programs.

A next-item model's artifact (HSTU, SASRec: ``manifest["task"] == "next_item"``) is loaded by
``recscale_next_item.NextItemModel`` beside this file, which reads it with
:func:`read_artifact`; :class:`Model` refuses it, naming that loader.

A model trained on a feature spec (``data.kind=tabular``), Frappe or Criteo also takes raw rows,
as in its data files: ``model.encode(rows)`` gives the inputs training gave them
(:class:`RowEncoder`), and ``python recscale_model.py MODEL FILE [--out SCORES]`` scores a whole
data file.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import zipfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "recscale-serving/1"
MANIFEST, WEIGHTS, FORWARD = "manifest.json", "weights.npz", "forward.jax"
VOCAB = "vocab.npz"  # the arrays of the data's encoding (``RowEncoder``)
TABULAR = "tabular/1"
ROWS = "recscale_rows.py"  # the artifact's copy of ``recscale/serving/rows.py``, beside this file
NEXT_ITEM = "recscale_next_item.py"  # ... of ``recscale/serving/next_item.py``
CTR = "ctr"  # a manifest's task: probabilities of examples (this module's Model)
LOADERS = {CTR: "recscale_model.Model", "next_item": "recscale_next_item.NextItemModel"}
"""Each task's loader, in an artifact's folder (named in the error for a model of another)."""

if __package__ == "recscale.serving":
    from recscale.serving.rows import (
        CACHE_BYTES,
        ArtifactError,
        Malformed,
        RowEncoder,
        read_rows,
        show,
    )
else:  # an artifact's recscale_model.py: its encoder is the recscale_rows.py beside it (the
    # folder is on sys.path, as for recscale_model itself)
    from recscale_rows import CACHE_BYTES, ArtifactError, Malformed, RowEncoder, read_rows, show

__all__ = ["FORMAT", "ArtifactError", "Model", "RowEncoder", "main", "read_artifact", "read_rows"]


def read_artifact(
    path: Path, task: str, programs: tuple[str, ...]
) -> tuple[dict, dict[str, np.ndarray], dict[str, Any]]:
    """``(manifest, {name: weight}, {file: jax.export.Exported})`` of the artifact at ``path``,
    a model of ``task`` (``ctr`` or ``next_item``) whose programs are the files ``programs``:
    the format, the task and every weight's shape against the manifest checked; an
    :class:`ArtifactError` naming the file and field where it is malformed."""
    man_path = path / MANIFEST
    if not man_path.is_file():
        raise ArtifactError(f"{man_path}: not found (is {path} a recscale serving artifact?)")
    try:
        manifest = json.loads(man_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{man_path}: not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise ArtifactError(f"{man_path}: format {fmt!r}, expected {FORMAT}")
    found = manifest.get("task", CTR)  # artifacts before next-item models have no task
    if found != task:
        raise ArtifactError(
            f"{man_path}: a model of task {show(found)}; this loader reads {task} models "
            f"({LOADERS.get(found, 'none of ours')} reads {show(found)})"
        )
    for key in ("inputs", "weights"):
        if not isinstance(manifest.get(key), dict):
            raise ArtifactError(f"{man_path}: the {key!r} field is missing")
    try:
        z = np.load(path / WEIGHTS, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ArtifactError(f"{path / WEIGHTS}: not a weights archive ({e})") from None
    with z:
        weights = {}
        for name, meta in manifest["weights"].items():
            if name not in z:
                raise ArtifactError(f"{path / WEIGHTS}: weight {name!r} is missing")
            a = z[name]
            try:
                weights[name] = a.view(jnp.bfloat16) if meta["dtype"] == "bfloat16" else a
                want = list(meta["shape"])
            except (KeyError, TypeError) as e:
                raise ArtifactError(f"{man_path}: {Malformed(f'weights.{name}', e)}") from None
            if list(weights[name].shape) != want:
                raise ArtifactError(
                    f"{path / WEIGHTS}: weight {name!r} has shape "
                    f"{list(a.shape)}, the manifest says {meta['shape']}"
                )
    try:
        import flatbuffers  # noqa: F401, PLC0415
    except ImportError:
        raise ArtifactError(
            f"reading {path / programs[0]} needs the flatbuffers package (jax.export's format; "
            "jax does not install it): pip install flatbuffers"
        ) from None
    exported = {}
    for name in programs:
        try:
            exported[name] = jax.export.deserialize(bytearray((path / name).read_bytes()))
        except Exception as e:  # noqa: BLE001 - flatbuffers and jax raise many kinds
            raise ArtifactError(
                f"{path / name}: not a serialised jax.export module ({type(e).__name__}: {e})"
            ) from None
    return manifest, weights, exported


class _Arrays(dict):
    """An archive's arrays; a missing one is an :class:`ArtifactError` naming the file."""

    def __init__(self, path: Path, arrays: dict):
        super().__init__(arrays)
        self.path = path

    def __missing__(self, key: str):
        raise ArtifactError(f"{self.path}: array {key!r} is missing")


class Model:
    """An exported model, its weights on one device."""

    def __init__(
        self,
        manifest: dict,
        weights: dict[str, np.ndarray],
        exported: Any,
        device: Any = None,
        vocab_arrays: dict[str, np.ndarray] | None = None,
        cache_bytes: int = CACHE_BYTES,
    ):
        self.manifest = manifest
        try:
            inputs = manifest["inputs"]
            self.dense_names = list(inputs["dense"])
            self.features = list(inputs["features"])
            self.max_hotness = int(inputs["max_hotness"])
            self.vocab_sizes = np.array([f["vocab_size"] for f in self.features], np.int64)
            self.hotness = np.array([f["max_hotness"] for f in self.features], np.int64)
            for f in self.features:
                str(f["name"])
        except (KeyError, TypeError, ValueError) as e:
            raise Malformed("inputs", e) from None
        self.exported = exported
        self.device = device or jax.devices()[0]
        self.weights = jax.device_put(weights, self.device)
        self._call = jax.jit(exported.call)
        self._lock = threading.Lock()
        self.counters = {"requests": 0, "examples": 0, "out_of_vocab_ids": 0}
        vocab = manifest.get("vocab")
        try:
            self.rows = None
            if vocab:
                dict(vocab["format"])
                self.rows = RowEncoder(vocab, vocab_arrays or {}, self.max_hotness, cache_bytes)
        except ArtifactError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise Malformed("vocab", e) from None

    @classmethod
    def load(cls, path: str | Path, device: Any = None, cache_bytes: int = CACHE_BYTES) -> Model:
        """The artifact at ``path`` (``cache_bytes``: the raw-row encoder's memory for values it
        remembers, :class:`RowEncoder`); an :class:`ArtifactError` naming the file and field
        where it is malformed."""
        path = Path(path)
        manifest, weights, programs = read_artifact(path, CTR, (FORWARD,))
        arrays, vocab = None, manifest.get("vocab")
        if vocab is not None and (not isinstance(vocab, dict) or vocab.get("kind") != TABULAR):
            kind = vocab.get("kind") if isinstance(vocab, dict) else vocab
            raise ArtifactError(
                f"{path / MANIFEST}: vocabulary kind {kind!r} is not supported by this "
                f"loader ({TABULAR}): export the model again"
            )
        if vocab:
            try:
                with np.load(path / VOCAB, allow_pickle=False) as z:
                    arrays = _Arrays(path / VOCAB, {k: z[k] for k in z.files})
            except (OSError, ValueError, zipfile.BadZipFile) as e:
                raise ArtifactError(f"{path / VOCAB}: not a vocabulary archive ({e})") from None
        try:
            return cls(manifest, weights, programs[FORWARD], device, arrays, cache_bytes)
        except Malformed as e:
            raise ArtifactError(f"{path / MANIFEST}: {e}") from None

    def encode(self, rows: list[dict]) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        """``(dense [B, N], ids [B, F, H], counts)`` from JSON-like requests, one per example.

        An artifact with its data's encoding (``manifest["vocab"]``: a feature-spec run's,
        Frappe's, Criteo's) takes raw rows, objects of column: value as in its data files
        (:class:`RowEncoder`). Others (synthetic data) take encoded examples,
        ``{"dense": {name: number} | [numbers], "features": {name: id or list of ids}}``: a
        feature left out is an empty bag (counted in ``missing_features``); an unknown feature,
        a wrong type, a missing dense value or a bag longer than the feature's raise
        :class:`ArtifactError` naming the example and field."""
        if self.rows is not None:
            return self.rows.encode(rows)
        n, f, h = len(self.dense_names), len(self.features), self.max_hotness
        dense = np.zeros((len(rows), n), np.float32)
        ids = np.full((len(rows), f, h), -1, np.int64)
        counts = {"unseen_values": 0, "missing_features": 0}
        index = {feat["name"]: i for i, feat in enumerate(self.features)}
        for r, row in enumerate(rows):
            where = f"example {r}"
            if not isinstance(row, dict):
                raise ArtifactError(f"{where}: expected an object with dense and features")
            unknown = set(row) - {"dense", "features"}
            if unknown:
                raise ArtifactError(
                    f"{where}: unknown field {show(sorted(unknown)[0])} (expected dense, features)"
                )
            dv = row.get("dense", {} if n == 0 else None)
            if isinstance(dv, dict):
                extra = set(dv) - set(self.dense_names)
                if extra:
                    raise ArtifactError(f"{where}: unknown dense feature {show(sorted(extra)[0])}")
                missing = [d for d in self.dense_names if d not in dv]
                if missing:
                    raise ArtifactError(f"{where}: dense feature {missing[0]!r} is missing")
                dv = [dv[d] for d in self.dense_names]
            if not isinstance(dv, list) or len(dv) != n:
                raise ArtifactError(
                    f"{where}: dense must be {n} numbers or an object of "
                    f"{', '.join(self.dense_names) or 'nothing'}"
                )
            for j, x in enumerate(dv):
                if isinstance(x, bool) or not isinstance(x, int | float):
                    raise ArtifactError(
                        f"{where}: dense feature {self.dense_names[j]!r} must be "
                        f"a number, got {type(x).__name__}"
                    )
                try:
                    dense[r, j] = x
                except OverflowError:
                    raise ArtifactError(
                        f"{where}: dense feature {self.dense_names[j]!r}: {show(x)} is out of range"
                    ) from None
            feats = row.get("features", {})
            if not isinstance(feats, dict):
                raise ArtifactError(f"{where}: features must be an object of feature: values")
            for name in feats:
                if name not in index:
                    raise ArtifactError(f"{where}: unknown feature {show(name)}")
            counts["missing_features"] += f - len(feats)
            for name, value in feats.items():
                i = index[name]
                values = value if isinstance(value, list) else [value]
                if len(values) > self.features[i]["max_hotness"]:
                    raise ArtifactError(
                        f"{where}: feature {name!r} has {len(values)} values, at "
                        f"most {self.features[i]['max_hotness']}"
                    )
                for k, v in enumerate(values):
                    ids[r, i, k] = self._id(name, v, where)
        return dense, ids, counts

    @staticmethod
    def _id(name: str, v: Any, where: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ArtifactError(
                f"{where}: feature {name!r}: ids are integers, got {type(v).__name__} {show(v)}"
            )
        return v if -(2**62) < v < 2**62 else -2  # an id that large: out of vocabulary

    def check(self, dense_bn: Any, ids_bfh: Any) -> tuple[np.ndarray, np.ndarray, int]:
        """``(dense float32 [B, N], ids int32 [B, F, H], out-of-vocabulary ids)`` from the inputs;
        a clear :class:`ArtifactError` for wrong shapes, types, non-finite dense values or a bag
        longer than its feature's."""
        try:
            dense = np.asarray(dense_bn)
        except (ValueError, TypeError) as e:
            raise ArtifactError(f"dense: not an array of numbers ({e})") from None
        try:
            ids = np.asarray(ids_bfh)
        except (ValueError, TypeError) as e:
            raise ArtifactError(f"ids: not an array of integers ({e})") from None
        n, f = len(self.dense_names), len(self.features)
        if dense.ndim != 2 or dense.shape[1] != n:
            raise ArtifactError(
                f"dense: expected [B, {n}] ({', '.join(self.dense_names) or 'none'}),"
                f" got shape {list(dense.shape)}"
            )
        if dense.dtype == bool or not np.issubdtype(dense.dtype, np.number):
            raise ArtifactError(f"dense: expected numbers, got {dense.dtype}")
        dense = dense.astype(np.float32)
        if not np.isfinite(dense).all():
            r, c = np.argwhere(~np.isfinite(dense))[0]
            raise ArtifactError(
                f"dense: example {r}, {self.dense_names[c]!r} is not finite ({dense[r, c]})"
            )
        if ids.ndim != 3 or ids.shape[1] != f or ids.shape[2] > self.max_hotness:
            raise ArtifactError(
                f"ids: expected [B, {f}, H <= {self.max_hotness}], got shape {list(ids.shape)}"
            )
        if ids.shape[0] != dense.shape[0]:
            raise ArtifactError(f"dense has {dense.shape[0]} rows, ids {ids.shape[0]}")
        if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
            raise ArtifactError(f"ids: expected integers, got {ids.dtype}")
        ids = ids.astype(np.int64)
        slot = np.arange(ids.shape[2])[None, None, :]
        too_long = (ids >= 0) & (slot >= self.hotness[None, :, None])
        if too_long.any():
            r, j, _ = np.argwhere(too_long)[0]
            raise ArtifactError(
                f"ids: example {r}, feature {self.features[j]['name']!r} has more "
                f"than its {self.hotness[j]} ids"
            )
        bad = (ids < -1) | (ids >= self.vocab_sizes[None, :, None])
        ids = np.where(bad, -1, ids).astype(np.int32)
        if ids.shape[2] < self.max_hotness:
            pad = self.max_hotness - ids.shape[2]
            ids = np.pad(ids, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
        return dense, ids, int(bad.sum())

    def predict(self, dense_bn: Any, ids_bfh: Any) -> np.ndarray:
        """Probabilities ``float32 [B]``."""
        dense, ids, oov = self.check(dense_bn, ids_bfh)
        with self._lock:
            self.counters["out_of_vocab_ids"] += oov
        return self.predict_checked(dense, ids)

    def predict_checked(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """:meth:`predict` of inputs :meth:`check` returned (thread-safe)."""
        b = dense.shape[0]
        size = 1 << max(0, (b - 1).bit_length())  # the next power of two
        if size != b:
            dense = np.pad(dense, ((0, size - b), (0, 0)))
            ids = np.pad(ids, ((0, size - b), (0, 0), (0, 0)), constant_values=-1)
        out = np.asarray(self._call(self.weights, dense, ids))[:b]
        with self._lock:
            self.counters["requests"] += 1
            self.counters["examples"] += b
        return out

    def warmup(self, max_batch: int) -> list[int]:
        """Compiles the program of every batch size a request up to ``max_batch`` examples can
        be padded to (powers of two), so no request waits for a compilation; returns them."""
        sizes = [1 << k for k in range(max(0, (max_batch - 1).bit_length()) + 1)]
        n, f = len(self.dense_names), len(self.features)
        for b in sizes:
            self._call(
                self.weights,
                np.zeros((b, n), np.float32),
                np.full((b, f, self.max_hotness), -1, np.int32),
            )
        return sizes


def main(argv: list[str] | None = None) -> int:
    """``python recscale_model.py MODEL FILE [--batch-size N] [--out SCORES]``: scores every
    row of a raw data file (of a feature-spec, Frappe or Criteo run), one probability a line.
    A bad row stops it with one line naming the file and line (``--out`` is written whole or
    not at all)."""
    import argparse
    import os
    import sys
    import tempfile

    ap = argparse.ArgumentParser(prog="recscale_model.py", description=main.__doc__)
    ap.add_argument("model")
    ap.add_argument("file")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--out", default="", help="scores file ('' = standard output)")
    args = ap.parse_args(argv)
    tmp = ""  # a new file of its own beside --out (never a fixed name a user's file may have)
    totals: dict[str, int] = {}
    try:
        if args.out:
            fd, tmp = tempfile.mkstemp(
                prefix=f".{os.path.basename(args.out)}.",
                suffix=".partial",
                dir=os.path.dirname(os.path.abspath(args.out)),
            )
            os.close(fd)
        model = Model.load(args.model)
        if model.rows is None:
            raise ArtifactError(
                f"{args.model}: has no encoding of raw rows (synthetic data: "
                "score it with Model.predict on encoded inputs)"
            )
        pairs = read_rows(
            args.file, model.manifest["vocab"]["format"], model.rows.columns, lines=True
        )
        with open(tmp, "w") if tmp else contextlib.nullcontext(sys.stdout) as out:
            while batch := list(itertools.islice(pairs, max(args.batch_size, 1))):
                try:
                    dense, ids, counts = model.encode([row for _, row in batch])
                except ArtifactError as e:
                    if e.example is None:
                        raise
                    raise ArtifactError(
                        f"{args.file}: line {batch[e.example][0]}: {e.detail}"
                    ) from None
                out.writelines(f"{p:.9g}\n" for p in model.predict(dense, ids))
                for k, v in counts.items():
                    totals[k] = totals.get(k, 0) + v
        if tmp:
            os.replace(tmp, args.out)
            tmp = ""
    except (ArtifactError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if tmp and os.path.exists(tmp):  # the file this call made, never replaced
            os.remove(tmp)
    print(json.dumps({"file": args.file, **totals}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
