"""The sharded embedding engine: tables laid out over the mesh by a plan, pooled lookups with
``shard_map`` collectives, and sparse in-place updates of the rows a batch touches.

One subsystem, three modules, followed in the order a batch of ids meets them:

- :mod:`recscale.embeddings.layout`: what is stored where. :class:`EngineSpec` (from the
  config; models pass it to their ``EmbeddingCollection``), the planner's shards packed into
  per-width **buffers** ``[N·R, w]`` (:func:`build_layout`), tables copied in and out
  (:func:`init_buffers`, :func:`export_tables`). Host-side, static.
- :mod:`recscale.embeddings.lookup`: the forward. Ids all-gathered, each device's slots pooled
  by the embedding-bag kernel, partial outputs returned by an all-to-all and assembled
  (:func:`lookup`); inside a train step (:func:`step_context`) each lookup adds a zero delta and
  records the rows it read.
- :mod:`recscale.embeddings.update`: the backward fused with the optimizer. The deltas'
  gradients become row gradients and the rows are updated in place (:func:`apply_update`): SGD,
  row-wise Adagrad, lazy Adam. Never a table gradient.

Re-layout of a checkpoint onto another mesh or plan: :mod:`recscale.embeddings.relayout`. The
row math (distinct rows, row gradients, row-wise Adagrad) is the embedding-update kernels'
reference (``recscale.kernels.embedding_update.reference``), the one copy every path runs.

Dimension glossary: ``N`` devices, ``B`` global batch, ``F`` features, ``H`` bag slots, ``S``
slots per device, ``U = B·H`` distinct-row bound of a slot, ``R`` rows per device block, ``w``
a buffer's width, ``ΣD`` the features' total width.
"""

from recscale.embeddings.layout import (
    COLUMN_TYPES,
    DTYPES,
    LANES,
    BufferLayout,
    EngineSpec,
    Layout,
    build_layout,
    compare_planners,
    default_profile,
    export_tables,
    generated_rows,
    init_buffers,
    plan_engine,
    rows_view,
    stored_view,
)
from recscale.embeddings.lookup import (
    engine_collections,
    lookup,
    step_context,
    with_error_bounds,
)
from recscale.embeddings.update import (
    EngineOptState,
    UpdateRule,
    apply_update,
    init_opt_state_for,
    row_gradient_sq,
)

__all__ = [
    "COLUMN_TYPES",
    "DTYPES",
    "LANES",
    "BufferLayout",
    "EngineOptState",
    "EngineSpec",
    "Layout",
    "UpdateRule",
    "apply_update",
    "build_layout",
    "compare_planners",
    "default_profile",
    "engine_collections",
    "export_tables",
    "generated_rows",
    "init_buffers",
    "init_opt_state_for",
    "lookup",
    "plan_engine",
    "row_gradient_sq",
    "rows_view",
    "step_context",
    "stored_view",
    "with_error_bounds",
]
