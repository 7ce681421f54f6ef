"""A dataset's schema from its config, without reading rows or importing grain/jax (sweeps
size models with it before launching them)."""

from __future__ import annotations

import dataclasses

from data.batch import Schema
from data.config import DataConfig


def capped(schema: Schema, max_rows: int) -> Schema:
    """``schema`` with every vocabulary larger than ``max_rows`` cut to it (0 = unchanged)."""
    if not max_rows:
        return schema
    return dataclasses.replace(
        schema,
        features=tuple(
            dataclasses.replace(f, vocab_size=min(f.vocab_size, max_rows)) for f in schema.features
        ),
    )


def schema_of(cfg: DataConfig) -> Schema:
    """The schema ``make_source(cfg)`` would give, without reading any rows (Frappe still reads
    the training file's vocabulary; tabular data is prepared on first use). Sweeps use it to size models before launching them."""
    if cfg.kind == "synthetic":
        from data.synthetic import synthetic_schema

        return capped(synthetic_schema(cfg.synthetic), cfg.max_table_rows)
    if cfg.kind == "frappe":
        from data.frappe.reader import build_frappe_vocab, frappe_schema

        return frappe_schema(build_frappe_vocab(cfg.train_path))
    if cfg.kind == "criteo":
        from data.criteo.reader import criteo_schema

        return criteo_schema(cfg.criteo.vocab_sizes)
    if cfg.kind == "tabular":
        from data.tabular.prepare import prepare

        return prepare(
            cfg.tabular.spec, cfg.tabular.prepared_dir, workers=cfg.tabular.workers
        ).schema
    raise ValueError(f"data.kind={cfg.kind!r} has no schema")
