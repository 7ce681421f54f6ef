"""EmbeddingCollection: the tables of a model and the pooled lookup of multi-hot bags.

Models call only ``EmbeddingCollection(ids_bfh) -> emb_bfd``. How rows are stored, sharded,
looked up and updated is this module's business (and, when the model passes it an ``EngineSpec``, the
sharded engine's: ``recscale.embeddings.engine``), so it can change without touching model code.

Dimension glossary: ``B`` batch, ``F`` features, ``H`` bag slots, ``D`` embedding dim,
``V`` table rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data.batch import Schema
from recscale import sharding
from recscale.embeddings import layout as layout_lib
from recscale.embeddings import lookup as lookup_lib
from recscale.embeddings.spec import FeatureSpec, TableSpec, one_table_per_feature
from recscale.kernels.embedding_bag import api as bag_api
from recscale.kernels.quantized_embedding_bag import api as q_api
from recscale.kernels.quantized_embedding_bag import precision as prec


@dataclasses.dataclass
class Probe:
    """Within :func:`probe`: ``deltas`` ``{feature: [B, D]}`` added to each feature's pooled
    outputs (None: only their shapes are recorded, in ``shapes``); the outputs, deltas added, in
    ``outputs``; each feature's table in ``tables``. Gradients with respect to the deltas are
    the loss's with respect to the pooled embeddings, whatever path looked them up. A feature
    looked up again (by another collection, as FinalMLP's gate contexts do) is keyed
    ``name#2``, ``name#3``, ... in the order of the lookups; ``owners`` has each key's collection
    and feature spec."""

    deltas: dict | None
    outputs: dict = dataclasses.field(default_factory=dict)
    shapes: dict = dataclasses.field(default_factory=dict)
    tables: dict = dataclasses.field(default_factory=dict)
    owners: dict = dataclasses.field(default_factory=dict)


_PROBE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar(
    "recscale_embedding_probe", default=None
)


@contextlib.contextmanager
def probe(deltas: dict | None) -> Iterator[Probe]:
    """Records (and perturbs by ``deltas``) every collection's pooled outputs per table, for
    measurements of the model's sensitivity to them (``recscale.analysis.comm_sensitivity``)."""
    p = Probe(deltas)
    token = _PROBE.set(p)
    try:
        yield p
    finally:
        _PROBE.reset(token)


def _probed(coll: EmbeddingCollection, outs: list[jax.Array]) -> list[jax.Array]:
    p = _PROBE.get()
    if p is None:
        return outs
    res = []
    for f, x in zip(coll.feature_specs, outs, strict=True):
        key, k = f.name, 1
        while key in p.tables:  # the same feature in another collection (FinalMLP's gates)
            k += 1
            key = f"{f.name}#{k}"
        p.tables[key] = f.table
        p.owners[key] = (coll, f)
        if p.deltas is None:
            p.shapes[key] = jax.ShapeDtypeStruct(x.shape, x.dtype)
        else:
            x = x + p.deltas[key]
            p.outputs[key] = x
        res.append(x)
    return res


class EmbeddingTable(nnx.Param):
    """A table's parameter type: optimizers and the trainer select tables by this type."""


class QuantizedTable(nnx.Param):
    """An int8 row-wise quantized table (``q`` uint8 and ``scale_bias``), for inference only:
    see :meth:`EmbeddingCollection.quantize_int8`."""


def _init_table(spec: TableSpec, rows: int, key: jax.Array, dtype) -> jax.Array:
    if spec.init == "uniform_sqrt_rows":
        bound = 1.0 / jnp.sqrt(spec.num_rows)
        table = jax.random.uniform(key, (rows, spec.dim), dtype, -bound, bound)
    else:
        table = spec.init_scale * jax.random.normal(key, (rows, spec.dim), dtype)
    # Padding rows (never looked up) are zero, so they do not change norms or checkpoints.
    return table.at[spec.num_rows :].set(0)


class EmbeddingCollection(nnx.Module):
    """Tables plus feature->table routing; pooled lookups of ``[B, F, H]`` id bags."""

    def __init__(
        self,
        tables: tuple[TableSpec, ...],
        features: tuple[FeatureSpec, ...],
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        engine: layout_lib.EngineSpec | None = None,
    ):
        """``engine``: lay the tables out in the sharded engine's buffers on the active mesh
        (``recscale.embeddings.engine``); None: one array per table, laid out by the active
        sharding rules."""
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in {names}")
        by_name = {t.name: t for t in tables}
        for f in features:
            if f.table not in by_name:
                raise ValueError(f"feature {f.name!r} reads unknown table {f.table!r}")
        self.table_specs = nnx.static(tuple(tables))
        self.feature_specs = nnx.static(tuple(features))
        self.int8 = nnx.static(False)
        self.serving = nnx.static(None)
        if engine is not None:
            # The sharded engine: tables cut into shards and packed into per-width buffers.
            mesh = sharding.active_mesh()
            n = 1 if mesh is None else int(mesh.shape[sharding.DATA_AXIS])
            if mesh is None:  # built by hand, outside a mesh: every table whole, no collective
                engine = dataclasses.replace(engine, sharding="data_parallel", per_table=())
            self.layout = nnx.static(
                layout_lib.build_layout(tuple(tables), tuple(features), n, engine)
            )
            keys = [rngs.params() for _ in tables]  # drawn in table order, as the per-table path

            def make_table(i):
                t = tables[i]
                rows = layout_lib.generated_rows(t.num_rows)
                return _init_table(t, rows, keys[i], param_dtype)[: t.num_rows]

            index = {t.name: i for i, t in enumerate(tables)}
            buffers = layout_lib.init_buffers(
                self.layout, make_table, [index[f.table] for f in features], len(tables)
            )
            self.buffers = nnx.Dict(
                {
                    bl.key: sharding.param(
                        EmbeddingTable, buffers[bl.key], None if bl.replicated else "shard", None
                    )
                    for bl in self.layout.buffers
                }
            )
            for bl in self.layout.buffers:  # packed rows: the optimizer state's rows are R
                self.buffers[bl.key].set_metadata("pack", bl.pack)
            return
        self.layout = nnx.static(None)
        self.tables = nnx.Dict(
            {
                t.name: sharding.param(
                    EmbeddingTable,
                    _init_table(t, sharding.padded_rows(t.num_rows), rngs.params(), param_dtype),
                    "vocab",
                    "embed",
                )
                for t in tables
            }
        )

    @classmethod
    def one_table_per_feature(
        cls,
        schema: Schema,
        dim: int,
        *,
        pooling: Literal["sum", "mean"] = "sum",
        init: Literal["uniform_sqrt_rows", "normal"] = "uniform_sqrt_rows",
        init_scale: float = 0.01,
        rngs: nnx.Rngs,
        engine: layout_lib.EngineSpec | None = None,
    ) -> EmbeddingCollection:
        """The usual layout: one ``dim``-wide table per sparse feature of ``schema``, except that
        features naming one ``table`` (``FeatureInfo.table``) share it."""
        tables, features = one_table_per_feature(
            tuple((f.name, f.vocab_size, f.max_hotness) for f in schema.features),
            dim,
            pooling=pooling,
            init=init,
            init_scale=init_scale,
        )
        if any(f.table for f in schema.features):
            rows: dict[str, int] = {}
            for f in schema.features:
                if rows.setdefault(f.table_name, f.vocab_size) != f.vocab_size:
                    raise ValueError(
                        f"features sharing table {f.table_name!r} have different vocab sizes "
                        f"({rows[f.table_name]} and {f.vocab_size} for {f.name!r})"
                    )
            first = {}
            for f, t in zip(schema.features, tables, strict=True):
                first.setdefault(f.table_name, dataclasses.replace(t, name=f.table_name))
            tables = tuple(first.values())
            features = tuple(
                dataclasses.replace(fs, table=f.table_name)
                for f, fs in zip(schema.features, features, strict=True)
            )
        return cls(tables, features, rngs=rngs, engine=engine)

    @classmethod
    def for_model(
        cls,
        cfg: Any,
        schema: Schema,
        *,
        rngs: nnx.Rngs,
        engine: layout_lib.EngineSpec | None = None,
    ) -> EmbeddingCollection:
        """:meth:`one_table_per_feature` as a model family builds it: ``cfg`` is the family's
        model config, whose ``embed_dim``, ``pooling``, ``embedding_init`` and
        ``embedding_init_scale`` size and initialise the tables."""
        return cls.one_table_per_feature(
            schema,
            cfg.embed_dim,
            pooling=cfg.pooling,
            init=cfg.embedding_init,
            init_scale=cfg.embedding_init_scale,
            rngs=rngs,
            engine=engine,
        )

    def quantize_int8(self) -> None:
        """Replaces the float tables by int8 row-wise quantized ones (FBGEMM's format: per row
        a uint8 code and a float32 scale and bias, ``recscale.kernels.quantized_embedding_bag``),
        looked up by the fused dequantize-and-pool kernel. For inference: a quarter of the
        float32 bytes (plus 8 per row), no gradients. Engine buffers are quantized per buffer row
        (a column shard's part of a row has its own scale and bias)."""
        if self.int8:
            raise ValueError("this embedding collection is already quantized")
        if self.layout is not None:
            self.buffers = nnx.Dict(
                {
                    bl.key: self._quantized(
                        layout_lib.rows_view(bl, self.buffers[bl.key][...]),
                        None if bl.replicated else "shard",
                    )
                    for bl in self.layout.buffers
                }
            )
        else:
            self.tables = nnx.Dict(
                {k: self._quantized(v[...], "vocab") for k, v in self.tables.items()}
            )
        self.int8 = nnx.static(True)

    def to_serving(self, tables: dict[str, Any], precisions: dict[str, str]) -> None:
        """Replaces the tables by ``tables`` ``{name: [V, D] float}`` stored in ``precisions``
        ``{name: precision}`` (``recscale.kernels.quantized_embedding_bag.precision``), looked up
        by its dequantising pooled lookup: the serving model. Inference only; one array per table (the engine's
        buffers are exported to tables first: ``engine.export_tables``)."""
        if self.int8 or self.serving is not None:
            raise ValueError("this embedding collection is already quantized")
        names = [t.name for t in self.table_specs]
        if set(tables) != set(names) or set(precisions) != set(names):
            raise ValueError(
                f"to_serving needs every table of {names}: got tables "
                f"{sorted(tables)}, precisions {sorted(precisions)}"
            )
        by_name = {t.name: t for t in self.table_specs}
        entries = {}
        for name in names:
            table = np.asarray(tables[name])[: by_name[name].num_rows]
            entries[name] = nnx.Dict(
                {k: QuantizedTable(v) for k, v in prec.quantize(table, precisions[name]).items()}
            )
        if self.layout is not None:
            del self.buffers
        self.layout = nnx.static(None)
        self.tables = nnx.Dict(entries)
        self.serving = nnx.static(tuple(sorted(precisions.items())))

    @staticmethod
    def _quantized(table: jax.Array, row_axis: str | None) -> nnx.Dict:
        q, scale_bias = q_api.quantize_rowwise(table)
        return nnx.Dict(
            q=sharding.param(QuantizedTable, q, row_axis, None),
            scale_bias=sharding.param(QuantizedTable, scale_bias, row_axis, None),
        )

    @property
    def output_dims(self) -> tuple[int, ...]:
        by_name = {t.name: t for t in self.table_specs}
        return tuple(by_name[f.table].dim for f in self.feature_specs)

    def _check_ids(self, ids_bfh: jax.Array) -> None:
        if ids_bfh.ndim != 3 or ids_bfh.shape[1] != len(self.feature_specs):
            raise ValueError(
                f"ids must be [B, F={len(self.feature_specs)}, H], got shape {ids_bfh.shape}"
            )

    def lookup(self, ids_bfh: jax.Array) -> list[jax.Array]:
        """Pooled embedding of every feature: a list of F arrays ``[B, D_f]``."""
        self._check_ids(ids_bfh)
        if self.serving is not None:
            precisions = dict(self.serving)
            dims = {t.name: t.dim for t in self.table_specs}
            return _probed(
                self,
                [
                    prec.pool(
                        {k: v[...] for k, v in self.tables[feat.table].items()},
                        precisions[feat.table],
                        ids_bfh[:, f, : feat.max_hotness],
                        dim=dims[feat.table],
                        pooling=feat.pooling,
                    )
                    for f, feat in enumerate(self.feature_specs)
                ],
            )
        if self.layout is not None:
            flat_bd = self._engine_lookup(ids_bfh)
            offsets = np.cumsum((0,) + self.layout.feature_dims)
            return _probed(
                self, [flat_bd[:, a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
            )
        # One array per table, laid out by the sharding rules: XLA partitions the reference's
        # gathers (a Pallas or FFI kernel is a custom call it cannot split, so the kernels run
        # in the engine, where every device holds its own blocks).
        if self.int8:
            return _probed(
                self,
                [
                    q_api.pool(
                        self.tables[feat.table]["q"][...],
                        self.tables[feat.table]["scale_bias"][...],
                        ids_bfh[:, f, : feat.max_hotness],
                        pooling=feat.pooling,
                        impl="xla",
                    )
                    for f, feat in enumerate(self.feature_specs)
                ],
            )
        return _probed(
            self,
            [
                bag_api.pool(
                    self.tables[feat.table][...],
                    ids_bfh[:, f, : feat.max_hotness],
                    pooling=feat.pooling,
                    impl="xla",
                )
                for f, feat in enumerate(self.feature_specs)
            ],
        )

    def _engine_lookup(self, ids_bfh: jax.Array) -> jax.Array:
        """``[B, ΣD]``: the engine's pooled embeddings of every feature, side by side."""
        if self.int8:  # (q, scale_bias) per buffer: the engine pools with the int8 kernel
            buffers = {k: (v["q"][...], v["scale_bias"][...]) for k, v in self.buffers.items()}
        else:
            buffers = {k: v[...] for k, v in self.buffers.items()}
        return lookup_lib.lookup(self, self.layout, buffers, ids_bfh)

    def __call__(self, ids_bfh: jax.Array) -> jax.Array:
        """Pooled embeddings stacked as ``[B, F, D]`` (all tables must share D)."""
        dims = set(self.output_dims)
        if len(dims) != 1:
            raise ValueError(
                f"stacking needs one embedding dim, tables have {sorted(dims)}; use lookup()"
            )
        if self.layout is not None and self.serving is None and _PROBE.get() is None:
            # the engine's [B, F·D] as [B, F, D]: one reshape, not a slice per feature
            # stacked again (whose backward XLA runs as F pads and adds)
            self._check_ids(ids_bfh)
            flat_bd = self._engine_lookup(ids_bfh)
            emb_bfd = flat_bd.reshape(flat_bd.shape[0], len(self.feature_specs), dims.pop())
        else:
            emb_bfd = jnp.stack(self.lookup(ids_bfh), axis=1)
        return sharding.constrain(emb_bfd, "batch", None, None)
