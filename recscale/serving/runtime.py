"""Load and run a recscale serving artifact with only numpy and jax (issue 20).

This file is copied into every artifact as ``recscale_model.py``; it imports nothing from
recscale, so a machine with jax installed runs an exported model without the project::

    from recscale_model import Model          # or: from recscale.serving.runtime import Model
    model = Model.load("MODEL")
    p = model.predict(dense_bn, ids_bfh)      # float32 [B] probabilities

Inputs: ``dense_bn`` float32 ``[B, N]`` in the order of ``manifest["inputs"]["dense"]``;
``ids_bfh`` int ``[B, F, H]`` per feature of ``manifest["inputs"]["features"]``, bags padded with
-1 (``H`` up to the artifact's ``max_hotness``; shorter bags are padded). An id outside its
feature's vocabulary is treated as a missing id (padding) and counted in
``Model.counters["out_of_vocab_ids"]``; nothing else is changed silently. Batches are padded to
the next power of two, so a server's varying batch sizes compile a handful of programs.
"""

from __future__ import annotations

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


class ArtifactError(ValueError):
    """A malformed artifact or input, with a message naming the file, field or feature."""


class Model:
    """An exported model, its weights on one device."""

    def __init__(self, manifest: dict, weights: dict[str, np.ndarray], exported: Any,
                 device: Any = None):  # fmt: skip
        self.manifest = manifest
        inputs = manifest["inputs"]
        self.dense_names = list(inputs["dense"])
        self.features = list(inputs["features"])
        self.max_hotness = int(inputs["max_hotness"])
        self.vocab_sizes = np.array([f["vocab_size"] for f in self.features], np.int64)
        self.hotness = np.array([f["max_hotness"] for f in self.features], np.int64)
        self.exported = exported
        self.device = device or jax.devices()[0]
        self.weights = jax.device_put(weights, self.device)
        self._call = jax.jit(exported.call)
        self._lock = threading.Lock()
        self.counters = {"requests": 0, "examples": 0, "out_of_vocab_ids": 0}
        self._sorted: dict[str, np.ndarray] = {}

    @classmethod
    def load(cls, path: str | Path, device: Any = None) -> Model:
        path = Path(path)
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
                weights[name] = a.view(jnp.bfloat16) if meta["dtype"] == "bfloat16" else a
                if list(weights[name].shape) != meta["shape"]:
                    raise ArtifactError(f"{path / WEIGHTS}: weight {name!r} has shape "
                                        f"{list(a.shape)}, the manifest says {meta['shape']}")  # fmt: skip
        try:
            exported = jax.export.deserialize(bytearray((path / FORWARD).read_bytes()))
        except Exception as e:  # noqa: BLE001 - flatbuffers and jax raise many kinds
            raise ArtifactError(f"{path / FORWARD}: not a serialised jax.export module "
                                f"({type(e).__name__}: {e})") from None  # fmt: skip
        try:
            return cls(manifest, weights, exported, device)
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"{man_path}: malformed inputs ({type(e).__name__}: {e})") from None

    def encode(self, rows: list[dict]) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        """``(dense [B, N], ids [B, F, H], counts)`` from JSON-like requests, one per example:
        ``{"dense": {name: number} | [numbers], "features": {name: value or list of values}}``.

        Feature values are raw values where the artifact has the data's vocabulary
        (``manifest["vocab"]``: unseen ones map to its OOV id and are counted in
        ``unseen_values``), ids otherwise. A feature left out is an empty bag (counted in
        ``missing_features``). An unknown feature, a wrong type, a missing dense value or a bag
        longer than the feature's raise :class:`ArtifactError` naming the example and field."""
        n, f, h = len(self.dense_names), len(self.features), self.max_hotness
        dense = np.zeros((len(rows), n), np.float32)
        ids = np.full((len(rows), f, h), -1, np.int64)
        counts = {"unseen_values": 0, "missing_features": 0}
        vocab = self.manifest.get("vocab") or None
        index = {feat["name"]: i for i, feat in enumerate(self.features)}
        for r, row in enumerate(rows):
            where = f"example {r}"
            if not isinstance(row, dict):
                raise ArtifactError(f"{where}: expected an object with dense and features")
            unknown = set(row) - {"dense", "features"}
            if unknown:
                raise ArtifactError(f"{where}: unknown field {sorted(unknown)[0]!r} (expected "
                                    "dense, features)")  # fmt: skip
            dv = row.get("dense", {} if n == 0 else None)
            if isinstance(dv, dict):
                extra = set(dv) - set(self.dense_names)
                if extra:
                    raise ArtifactError(f"{where}: unknown dense feature {sorted(extra)[0]!r}")
                missing = [d for d in self.dense_names if d not in dv]
                if missing:
                    raise ArtifactError(f"{where}: dense feature {missing[0]!r} is missing")
                dv = [dv[d] for d in self.dense_names]
            if not isinstance(dv, list) or len(dv) != n:
                raise ArtifactError(f"{where}: dense must be {n} numbers or an object of "
                                    f"{', '.join(self.dense_names) or 'nothing'}")  # fmt: skip
            for j, x in enumerate(dv):
                if isinstance(x, bool) or not isinstance(x, int | float):
                    raise ArtifactError(f"{where}: dense feature {self.dense_names[j]!r} must be "
                                        f"a number, got {type(x).__name__}")  # fmt: skip
                try:
                    dense[r, j] = x
                except OverflowError:
                    raise ArtifactError(f"{where}: dense feature {self.dense_names[j]!r}: {x!r} "
                                        "is out of range") from None  # fmt: skip
            feats = row.get("features", {})
            if not isinstance(feats, dict):
                raise ArtifactError(f"{where}: features must be an object of feature: values")
            for name in feats:
                if name not in index:
                    raise ArtifactError(f"{where}: unknown feature {name!r}")
            counts["missing_features"] += f - len(feats)
            for name, value in feats.items():
                i = index[name]
                values = value if isinstance(value, list) else [value]
                if len(values) > self.features[i]["max_hotness"]:
                    raise ArtifactError(f"{where}: feature {name!r} has {len(values)} values, at "
                                        f"most {self.features[i]['max_hotness']}")  # fmt: skip
                for k, v in enumerate(values):
                    ids[r, i, k] = self._id(name, v, vocab, counts, where)
        return dense, ids, counts

    def _id(self, name: str, v: Any, vocab: dict | None, counts: dict, where: str) -> int:
        if vocab is None:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ArtifactError(f"{where}: feature {name!r}: ids are integers, got "
                                    f"{type(v).__name__} {v!r}")  # fmt: skip
            return v if -(2**62) < v < 2**62 else -2  # an id that large: out of vocabulary
        if vocab["kind"] != "sorted_values":
            raise ArtifactError(f"vocabulary kind {vocab['kind']!r} is not supported")
        table = self._sorted.get(name)
        if table is None:
            table = self._sorted[name] = np.asarray(vocab["features"][name])
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise ArtifactError(f"{where}: feature {name!r}: expected a raw value, got "
                                f"{type(v).__name__} {v!r}")  # fmt: skip
        try:
            v = int(v)
        except ValueError:
            raise ArtifactError(f"{where}: feature {name!r}: {v!r} is not an integer") from None
        if not -(2**62) < v < 2**62:  # beyond any vocabulary
            counts["unseen_values"] += 1
            return int(vocab["oov_id"])
        pos = int(np.searchsorted(table, v))
        if pos < table.size and table[pos] == v:
            return pos + 1
        counts["unseen_values"] += 1
        return int(vocab["oov_id"])

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
            raise ArtifactError(f"dense: expected [B, {n}] ({', '.join(self.dense_names) or 'none'}),"
                                f" got shape {list(dense.shape)}")  # fmt: skip
        if dense.dtype == bool or not np.issubdtype(dense.dtype, np.number):
            raise ArtifactError(f"dense: expected numbers, got {dense.dtype}")
        dense = dense.astype(np.float32)
        if not np.isfinite(dense).all():
            r, c = np.argwhere(~np.isfinite(dense))[0]
            raise ArtifactError(f"dense: example {r}, {self.dense_names[c]!r} is not finite "
                                f"({dense[r, c]})")  # fmt: skip
        if ids.ndim != 3 or ids.shape[1] != f or ids.shape[2] > self.max_hotness:
            raise ArtifactError(f"ids: expected [B, {f}, H <= {self.max_hotness}], got shape "
                                f"{list(ids.shape)}")  # fmt: skip
        if ids.shape[0] != dense.shape[0]:
            raise ArtifactError(f"dense has {dense.shape[0]} rows, ids {ids.shape[0]}")
        if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
            raise ArtifactError(f"ids: expected integers, got {ids.dtype}")
        ids = ids.astype(np.int64)
        slot = np.arange(ids.shape[2])[None, None, :]
        too_long = (ids >= 0) & (slot >= self.hotness[None, :, None])
        if too_long.any():
            r, j, _ = np.argwhere(too_long)[0]
            raise ArtifactError(f"ids: example {r}, feature {self.features[j]['name']!r} has more "
                                f"than its {self.hotness[j]} ids")  # fmt: skip
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
