"""Export a trained run as a self-contained serving artifact (issue 20).

``python -m recscale.export --workdir DIR --out MODEL [--replace] [--precision int8]
[--table-precision user=float16 item=int4] [--platforms cpu cuda tpu]`` writes ``MODEL/``:

* ``forward.jax``: the model's forward pass, ``probabilities [B] = f(weights, dense [B, N],
  ids [B, F, H])``, serialised by ``jax.export`` (StableHLO, a symbolic batch size ``B``), lowered
  for each of ``platforms`` from this host (a GPU or TPU needs no recscale and no model code to
  run it, only jax);
* ``weights.npz``: every weight by name; the tables in their serving precision
  (``recscale.kernels.quantized_embedding_bag.precision``: float32, bfloat16, float16, int8 or int4 row-wise with a
  scale and bias per row; bfloat16 stored as its uint16 bits);
* ``manifest.json``: the format version, the run and checkpoint it came from, the inputs' names
  and shapes (dense feature names; per sparse feature its table, vocabulary size and bag size;
  ids ``-1`` pad a bag), each table's precision and bytes, the weights' dtypes and shapes, and
  how raw rows become inputs where the data says (``vocab``): the feature spec's encoding of a
  ``data.kind=tabular`` run, or Frappe's and Criteo's as their specs state them
  (``data/tabular/serving.py``);
* ``vocab.npz``: that encoding's vocabularies and side tables;
* ``recscale_model.py``, ``recscale_rows.py`` and ``recscale_next_item.py``: the loader
  (``recscale/serving/runtime.py``, its raw-row encoder ``rows.py`` and ``next_item.py``, which
  import only numpy and jax): ``Model.load(MODEL).predict(dense, ids)``, ``Model.encode(rows)``
  of raw rows, and ``python recscale_model.py MODEL FILE`` to score a raw data file.

A next-item model's run (``sequential``: HSTU, SASRec) is exported by its task's
``serving_parts`` hook instead (``sequential/serving.py``): ``top_k.jax`` and ``score.jax`` over
histories, the item table in float32, and ``task: next_item`` in the manifest, loaded by
``recscale_next_item.NextItemModel``; the folder, the weights, the checks and the loader files
are the same.

The engine's sharded buffers are exported to one array per table first
(``engine.export_tables``), so the artifact does not depend on the mesh or plan the run trained
with. The exported forward is the evaluation forward (no dropout, BatchNorm's running statistics)
with each table's lookup gathering and dequantising only the rows a bag reads.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recscale.config import KernelConfig
from recscale.embeddings import EmbeddingCollection, collection, engine
from recscale.kernels.quantized_embedding_bag import precision as prec
from recscale.metrics import EvalAccumulator
from recscale.serving import runtime
from recscale.serving.artifact import LOADER_FILES, ArtifactParts, check_out, swap_in
from recscale.train.evaluation import restored
from recscale.train.experiment import BuildModel

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
XLA_KERNELS = KernelConfig(
    embedding_bag="xla",
    embedding_update="xla",
    dot_interaction="xla",
    fm_interaction="xla",
    hstu_attention="xla",
)
"""The artifact's forward is plain StableHLO: every hot op in its jnp reference (a Pallas or
FFI kernel is a custom call of one backend; XLA compiles the references for each)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportArgs:
    """Export a trained run as a serving artifact."""

    workdir: str
    """The run's directory (holds config.json and checkpoints/)."""
    out: str
    """The artifact's directory (created; one that exists is refused unless ``replace``)."""
    replace: bool = False
    """Replace an existing ``out``: only a serving artifact (a manifest.json of this format and
    nothing but an artifact's files), swapped for the new one by rename once it is written."""
    step: int | None = None
    """Checkpoint step to export (default: the latest)."""
    best: bool = False
    """Export the early-stopping best checkpoint."""
    precision: str = "float32"
    """Every table's precision: float32, bfloat16, float16, int8 or int4 (row-wise); ``auto``:
    the smallest per table that keeps the validation AUC within ``auc_budget`` of float32's
    (:func:`choose_precisions`)."""
    auc_budget: float = 0.0002
    """``auto``: the most validation AUC the tables' precisions may cost together."""
    auto_candidates: tuple[str, ...] = ("int4", "int8", "float16")
    """``auto``: the precisions tried below float32, smallest first."""
    table_precision: tuple[str, ...] = ()
    """Per-table overrides, ``TABLE=PRECISION`` (e.g. ``item=int4``)."""
    platforms: tuple[str, ...] = ("cpu",)
    """Backends to lower the forward for (``cpu``, ``cuda``, ``rocm``, ``tpu``), from this host."""


def table_precisions(tables: list[str], default: str, overrides: tuple[str, ...]) -> dict[str, str]:
    """``{table: precision}`` from a default and ``TABLE=PRECISION`` overrides."""
    prec.check(default)
    out = dict.fromkeys(tables, default)
    for item in overrides:
        name, sep, p = item.partition("=")
        if not sep or name not in out:
            raise ValueError(
                f"table precision {item!r}: expected TABLE=PRECISION with TABLE one "
                f"of {', '.join(tables)}"
            )
        out[name] = prec.check(p)
    return out


def _collections(model: nnx.Module) -> list[EmbeddingCollection]:
    """The model's embedding collections (FinalMLP's gate contexts have their own tables, named
    like the main collection's)."""
    found = [m for _, m in nnx.iter_modules(model) if isinstance(m, EmbeddingCollection)]
    if not found:
        raise ValueError("the model has no embedding collection to export")
    return found


def float_tables(coll: EmbeddingCollection) -> dict[str, np.ndarray]:
    """``{table: [V, D] float32}`` of a trained collection, from the engine's buffers or the
    per-table arrays."""
    if coll.int8 or coll.serving is not None:
        raise ValueError("the collection is already quantized")
    if coll.layout is not None:
        bufs = {k: v[...] for k, v in coll.buffers.items()}
        return engine.export_tables(coll.layout, bufs, coll.table_specs, coll.feature_specs)
    return {
        t.name: np.asarray(jax.device_get(coll.tables[t.name][...]), np.float32)[: t.num_rows]
        for t in coll.table_specs
    }


def serving_model(graphdef, params, batch_stats, precisions: dict[str, str] | str):
    """``(model, {table: precision})``: the trained model with its tables in serving precision
    (a precision name for every table, or ``{table: precision}``)."""
    model = nnx.merge(graphdef, params, batch_stats)
    collections = _collections(model)
    if isinstance(precisions, str):
        names = {t.name for c in collections for t in c.table_specs}
        precisions = dict.fromkeys(sorted(names), prec.check(precisions))
    for coll in collections:  # a table's precision holds in every collection naming it
        tables = float_tables(coll)
        coll.to_serving(tables, {t: precisions[t] for t in tables})
    return model, precisions


def flat_weights(model: nnx.Module) -> tuple[nnx.GraphDef, dict[str, jax.Array], Any]:
    """``(graphdef, {name: array}, state structure)``: the model's parameters and statistics as
    plain named arrays (what the artifact stores and the exported function takes)."""
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    weights = {"/".join(map(str, path)): v[...] for path, v in flat}
    return graphdef, weights, [path for path, _ in flat]


def merged(graphdef: nnx.GraphDef, paths: list, weights: dict[str, jax.Array]) -> nnx.Module:
    """The model ``graphdef`` whose state is ``weights`` ``{name: array}`` (names and paths as
    :func:`flat_weights` gives them): what an exported program rebuilds from its arguments."""
    state = nnx.from_flat_state([(path, weights["/".join(map(str, path))]) for path in paths])
    return nnx.merge(graphdef, state)


def forward_fn(graphdef: nnx.GraphDef, paths: list) -> Any:
    """``f(weights, dense_bn, ids_bfh) -> probabilities [B]`` of the model ``graphdef`` whose
    state is ``weights`` (:func:`merged`)."""

    def forward(weights: dict[str, jax.Array], dense_bn: jax.Array, ids_bfh: jax.Array):
        model = merged(graphdef, paths, weights)
        return jax.nn.sigmoid(model(dense_bn, ids_bfh).astype(jnp.float32))

    return forward


def host_weights(model: nnx.Module) -> tuple[nnx.GraphDef, dict[str, np.ndarray], list]:
    """:func:`flat_weights` as host arrays (what the artifact stores)."""
    graphdef, weights, paths = flat_weights(model)
    return graphdef, {k: np.asarray(jax.device_get(v)) for k, v in weights.items()}, paths


def lower(fn: Any, weights: dict[str, np.ndarray], inputs: tuple, platforms: tuple[str, ...]):
    """The serialised ``jax.export`` of ``jit(fn)(weights, *inputs)`` (``inputs``:
    ``jax.ShapeDtypeStruct`` s, symbolic dimensions allowed), lowered for ``platforms``."""
    unknown = set(platforms) - set(PLATFORMS)
    if unknown or not platforms:
        raise ValueError(f"platforms {list(platforms)}: expected some of {', '.join(PLATFORMS)}")
    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in weights.items()}
    exported = jax.export.export(jax.jit(fn), platforms=tuple(platforms))(specs, *inputs)
    return bytes(exported.serialize())


def export_model(
    model: nnx.Module, num_dense: int, num_features: int, hotness: int, platforms: tuple[str, ...]
) -> tuple[bytes, dict[str, np.ndarray]]:
    """``(serialised exported forward, weights)`` of a serving model, for a symbolic batch."""
    graphdef, weights, paths = host_weights(model)
    (b,) = jax.export.symbolic_shape("b")
    inputs = (
        jax.ShapeDtypeStruct((b, num_dense), jnp.float32),
        jax.ShapeDtypeStruct((b, num_features, hotness), jnp.int32),
    )
    return lower(forward_fn(graphdef, paths), weights, inputs, platforms), weights


def _vocab(source: Any) -> tuple[dict | None, dict[str, np.ndarray]]:
    """``(description, arrays)`` of how the run's data maps raw rows to inputs, where its
    source knows (``data/tabular/serving.py``: a feature spec's, Frappe's and Criteo's)."""
    fn = getattr(source, "serving_encoding", None)
    return fn() if callable(fn) else (None, {})


def _auc(exp: Any, graphdef, params, batch_stats, precisions: dict[str, str]) -> tuple[float, int]:
    """``(validation AUC, table bytes)`` of the serving model with its tables in
    ``precisions`` (compiled for it)."""
    model, _ = serving_model(graphdef, params, batch_stats, precisions)
    size = sum(
        prec.nbytes({k: v[...] for k, v in coll.tables[t.name].items()})
        for coll in _collections(model)
        for t in coll.table_specs
    )
    g, p, st = nnx.split(model, nnx.Param, nnx.BatchStat)
    return float(exp.evaluate(p, st, graphdef=g)["auc"]), size


class _ProbeEvaluator:
    """Validation AUCs of one model under many table precisions, compiled once: each
    precision's effect enters as the difference of a feature's dequantised pooled embeddings
    from its float32 ones, added where the model reads them (``collection.probe``). The
    weights and tables are arguments of the compiled programs (not constants in them); batches
    stay on the host and each evaluation streams them, so memory does not grow with the
    evaluation set or the number of candidates. Equal to the serving model's AUC up to float32
    rounding of that addition (the final choice is measured on the real serving model).

    A model with several embedding collections (FinalMLP's gate contexts, tables named like the
    main collection's) has a table name's precision applied to every collection's table of
    that name, as the export does: each lookup's delta comes from its own collection's table
    (which collection looked a probe key up is recorded by tracing the model once)."""

    def __init__(self, exp: Any, graphdef, params, batch_stats):
        model = nnx.merge(graphdef, params, batch_stats)
        colls = _collections(model)
        self.exp = exp
        self.params, self.batch_stats = params, batch_stats
        # (collection, table) -> [V, D] float32
        self.tables = {
            (c, t): v for c, coll in enumerate(colls) for t, v in float_tables(coll).items()
        }
        self.dims = {t.name: t.dim for coll in colls for t in coll.table_specs}
        names = [f.name for f in exp.source.schema.features]
        # (probe key, collection, column of ids_bfh, table, bag size, pooling) per lookup
        self.features = [
            (key, c, names.index(f.name), f.table, f.max_hotness, f.pooling)
            for key, (c, f) in self._lookups(graphdef).items()
        ]
        self._quantized: dict[tuple[int, str, str], dict] = {}
        self._delta_fns: dict[tuple[str, str], Any] = {}
        self._sizes: dict[tuple[str, str], int] = {}

        @jax.jit
        def logits(params, batch_stats, batch, deltas):
            with collection.probe(deltas):
                return nnx.merge(graphdef, params, batch_stats)(batch.dense_bn, batch.ids_bfh)

        self._logits = logits

    def _lookups(self, graphdef) -> dict[str, tuple[int, Any]]:
        """``{probe key: (collection index, feature spec)}`` of every lookup the forward
        makes, from one abstract trace of it."""
        found: dict[str, tuple[int, Any]] = {}
        batch = self.exp.device_batch(next(iter(self.exp.source.eval_batches())))

        def trace(params, batch_stats, dense, ids):
            m = nnx.merge(graphdef, params, batch_stats)
            index = {id(c): i for i, c in enumerate(_collections(m))}
            with collection.probe(None) as p:
                m(dense, ids)
            found.update({k: (index[id(c)], f) for k, (c, f) in p.owners.items()})

        jax.eval_shape(trace, self.params, self.batch_stats, batch.dense_bn, batch.ids_bfh)
        return found

    def _delta(self, table: str, precision: str):
        key = (table, precision)
        feats = [f for f in self.features if f[3] == table]
        colls = sorted({c for _, c, *_ in feats})
        if key not in self._delta_fns:
            for c in colls:
                self._quantized[(c, *key)] = prec.quantize(self.tables[c, table], precision)
                self._quantized[c, table, "float32"] = prec.quantize(
                    self.tables[c, table], "float32"
                )
            dim = self.dims[table]

            @jax.jit
            def delta(q, f32, ids_bfh):
                return {
                    name: prec.pool(q[c], precision, ids_bfh[:, i, :h], dim=dim, pooling=pool)
                    - prec.pool(f32[c], "float32", ids_bfh[:, i, :h], dim=dim, pooling=pool)
                    for name, c, i, _, h, pool in feats
                }

            self._delta_fns[key] = delta
        fn = self._delta_fns[key]
        q = {c: self._quantized[(c, *key)] for c in colls}
        f32 = {c: self._quantized[c, table, "float32"] for c in colls}
        return lambda ids: fn(q, f32, ids)

    def auc(self, precisions: dict[str, str]) -> float:
        acc = EvalAccumulator()
        low = [self._delta(t, p) for t, p in precisions.items() if p != "float32"]
        for host in self.exp.source.eval_batches():
            b = self.exp.device_batch(host)
            deltas = {
                name: jnp.zeros((b.ids_bfh.shape[0], self.dims[t]), jnp.float32)
                for name, _, _, t, _, _ in self.features
            }
            for fn in low:
                deltas.update(fn(b.ids_bfh))
            out = self._logits(self.params, self.batch_stats, b, deltas)
            acc.update(np.asarray(out), np.asarray(b.labels_b), np.asarray(b.weights_b))
        return float(acc.result()["auc"])

    def bytes(self, precisions: dict[str, str]) -> int:
        for t, p in precisions.items():  # each table quantised once per precision
            if (t, p) not in self._sizes:
                self._sizes[t, p] = sum(
                    prec.nbytes(prec.quantize(v, p))
                    for (_, name), v in self.tables.items()
                    if name == t
                )
        return sum(self._sizes[t, p] for t, p in precisions.items())


def choose_precisions(
    exp: Any,
    graphdef,
    params,
    batch_stats,
    tables: list[str],
    *,
    budget: float,
    candidates: tuple[str, ...],
    pinned: dict[str, str] | None = None,
    log=print,
) -> dict[str, Any]:
    """The smallest precision per table that keeps the validation AUC within ``budget`` of the
    float32 model's, and what each choice measured.

    1. Each table alone in each candidate precision (the others float32): its AUC cost.
    2. Greedily, the change saving the most bytes per AUC it cost alone is made, and the
       combined model evaluated; it is kept if the combined AUC is still within ``budget`` of
       float32's, else undone.
    3. The final combination is measured on the serving model itself (not the probe).

    ``pinned`` tables keep their given precision throughout (the budget includes them; the
    reference is still all float32). Steps 1-2 run one compiled evaluation
    (:class:`_ProbeEvaluator`)."""
    for c in candidates:
        prec.check(c)
    if budget < 0:
        raise ValueError(f"auc_budget={budget}: must be >= 0")
    pinned = dict(pinned or {})
    ev = _ProbeEvaluator(exp, graphdef, params, batch_stats)
    float32 = dict.fromkeys(tables, "float32")
    base = {**float32, **pinned}
    free = [t for t in tables if t not in pinned]
    auc0, bytes0 = ev.auc(float32), ev.bytes(float32)
    # candidates by the bytes they take (smallest first), whatever order they were given in
    candidates = tuple(
        sorted(
            candidates, key=lambda c: prec.nbytes(prec.quantize(np.zeros((1, 8), np.float32), c))
        )
    )
    log(f"float32: AUC {auc0:.6f}, tables {bytes0 / 2**20:.3f} MiB")
    auc_b, bytes_b = (auc0, bytes0) if not pinned else (ev.auc(base), ev.bytes(base))
    solo: dict[str, dict[str, dict[str, float]]] = {t: {} for t in free}
    for t in free:  # each against the pinned base
        for c in candidates:
            trial = {**base, t: c}
            solo[t][c] = {
                "auc_cost": auc_b - ev.auc(trial),
                "bytes_saved": bytes_b - ev.bytes(trial),
            }
            log(
                f"  {t} in {c}: AUC cost {solo[t][c]['auc_cost']:+.6f}, saves "
                f"{solo[t][c]['bytes_saved'] / 2**20:.4f} MiB"
            )
    moves = sorted(
        ((t, c) for t in free for c in candidates if solo[t][c]["bytes_saved"] > 0),
        key=lambda tc: (
            -solo[tc[0]][tc[1]]["bytes_saved"] / max(solo[tc[0]][tc[1]]["auc_cost"], 1e-9)
        ),
    )
    chosen, tried = dict(base), []
    order = {c: i for i, c in enumerate(candidates)}  # smallest first
    for t, c in moves:
        if chosen[t] != "float32" and order[chosen[t]] <= order[c]:
            continue  # already as small
        trial = {**chosen, t: c}
        a = ev.auc(trial)
        ok = auc0 - a <= budget
        tried.append({"table": t, "precision": c, "auc": a, "kept": ok})
        log(f"  try {t}={c}: AUC {a:.6f} ({a - auc0:+.6f}) {'kept' if ok else 'undone'}")
        if ok:
            chosen = trial
    final_auc, final_bytes = _auc(exp, graphdef, params, batch_stats, chosen)
    ref_auc, _ = _auc(exp, graphdef, params, batch_stats, float32)
    log(
        f"chosen: AUC {final_auc:.6f} against float32's {ref_auc:.6f} (serving models), "
        f"tables {final_bytes / 2**20:.3f} MiB"
    )
    return {
        "precisions": chosen,
        "auc_float32": ref_auc,
        "auc": final_auc,
        "auc_cost": ref_auc - final_auc,
        "budget": budget,
        "bytes_float32": bytes0,
        "bytes": final_bytes,
        "solo": solo,
        "tried": tried,
    }


def manifest_inputs(schema) -> dict:
    """The manifest's ``inputs``: what a request carries (dense names, each feature's table,
    vocabulary and bag size, the padding id), as the loader (``runtime.Model``) reads it."""
    return {
        "dense": list(schema.dense_names),
        "features": [
            {
                "name": f.name,
                "table": f.table_name,
                "vocab_size": f.vocab_size,
                "max_hotness": f.max_hotness,
            }
            for f in schema.features
        ],
        "max_hotness": schema.max_hotness,
        "pad_id": -1,
    }


def _ctr_parts(r: Any, args: ExportArgs, log) -> ArtifactParts:
    """A CTR model's part of the artifact: its forward (``forward.jax``), its tables in their
    serving precisions, and its data's encoding of raw rows."""
    schema = r.exp.source.schema
    names = sorted({f.table_name for f in schema.features})
    auto = None
    if args.precision == "auto":
        pinned = dict(item.split("=", 1) for item in args.table_precision)
        table_precisions(names, "float32", args.table_precision)  # checked before the search
        auto = choose_precisions(
            r.exp,
            r.exp.graphdef,
            r.params,
            r.batch_stats,
            names,
            budget=args.auc_budget,
            candidates=args.auto_candidates,
            pinned=pinned,
            log=log,
        )
        precisions = auto["precisions"]
    else:
        precisions = table_precisions(names, args.precision, args.table_precision)
    model, precisions = serving_model(r.exp.graphdef, r.params, r.batch_stats, precisions)
    blob, weights = export_model(
        model, schema.num_dense, schema.num_sparse, schema.max_hotness, tuple(args.platforms)
    )
    table_bytes = dict.fromkeys(names, 0)  # summed over the collections holding a table
    dims = {}
    for coll in _collections(model):
        for t in coll.table_specs:
            table_bytes[t.name] += prec.nbytes({k: v[...] for k, v in coll.tables[t.name].items()})
            dims.setdefault(t.name, t.dim)
    vocab, vocab_arrays = _vocab(r.exp.source)
    manifest = {
        "task": runtime.CTR,
        "inputs": manifest_inputs(schema),
        "output": "probability of a positive label, float32 [B]",
        "tables": {
            n: {"precision": precisions[n], "dim": dims[n], "bytes": table_bytes[n]} for n in names
        },
        "table_bytes": sum(table_bytes.values()),
        "vocab": vocab,
        "auto_precision": auto,
    }
    # (no vocab.npz where every table is hashed and nothing is joined)
    arrays = vocab_arrays if vocab is not None else None
    return ArtifactParts(
        manifest=manifest, weights=weights, programs={runtime.FORWARD: blob}, arrays=arrays
    )


def export_workdir(
    config_cls: type, build_model: BuildModel, args: ExportArgs, family: str = "", log=None
) -> dict:
    """Writes the artifact of ``args`` and returns its manifest (``log``: progress lines, to
    stderr by default). The run's task makes its programs and manifest fields where it has a
    ``serving_parts(restored, args) -> ArtifactParts`` hook (``sequential.task``'s next-item
    models); else they are a CTR model's (:func:`_ctr_parts`)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    check_out(Path(args.out), Path(args.workdir), args.replace)
    t0 = time.perf_counter()
    with restored(
        config_cls,
        build_model,
        args.workdir,
        step=args.step,
        best=args.best,
        num_devices=1,
        kernels=XLA_KERNELS,
    ) as r:
        hook = getattr(r.exp.task, "serving_parts", None)
        parts = hook(r, args) if hook is not None else _ctr_parts(r, args, log)
        cfg, step = r.cfg, r.step
    weights = parts.weights
    stored = {k: (v.view(np.uint16) if v.dtype == jnp.bfloat16 else v) for k, v in weights.items()}
    manifest = {
        "format": runtime.FORMAT,
        "family": family,
        "source": {
            "workdir": str(Path(args.workdir).resolve()),
            "step": step,
            "data": cfg.data.kind,
            "eval_path": getattr(cfg.data, "eval_path", None),
        },
        "platforms": list(args.platforms),
        **parts.manifest,
        "weights": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in weights.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A new folder of its own beside ``out`` (never a fixed name, which might exist: ``X.tmp``
    # could be the run itself), deleted by this function only if the export fails.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        np.savez(tmp / runtime.WEIGHTS, **stored)
        for name, blob in parts.programs.items():
            (tmp / name).write_bytes(blob)
        if parts.arrays is not None:
            np.savez(tmp / runtime.VOCAB, **parts.arrays)
        (tmp / runtime.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        for name, module in LOADER_FILES.items():  # the jax-only loader
            shutil.copyfile(Path(module), tmp / name)
        swap_in(tmp, out, args.replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest["seconds"] = round(time.perf_counter() - t0, 2)
    return manifest
