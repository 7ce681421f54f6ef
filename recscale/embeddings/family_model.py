"""The base of every family's network: its config, its embedding tables over a schema's features,
then its own layers."""

from __future__ import annotations

from typing import Any

from flax import nnx

from data.batch import Schema
from recscale.config import KernelConfig
from recscale.embeddings.collection import EmbeddingCollection
from recscale.embeddings.layout import EngineSpec


class FamilyModel(nnx.Module):
    """A family's network (``DLRM``, ``Wukong``, ``DCNv2``, ...): ``cfg`` is its model config
    (a ``recscale.model_config.TablesConfig``), checked against the data; the tables come first
    (``EmbeddingCollection.for_model``), then the family's layers, in :meth:`build_layers`, so every
    family draws its initial parameters from ``rngs`` in the same order."""

    def __init__(
        self,
        cfg: Any,
        schema: Schema,
        *,
        kernels: KernelConfig | None = None,
        engine: EngineSpec | None = None,
        rngs: nnx.Rngs,
    ):
        self.cfg = nnx.static(cfg)
        self.kernels = nnx.static(kernels or KernelConfig())
        self.embeddings = EmbeddingCollection.for_model(cfg, schema, rngs=rngs, engine=engine)
        cfg.check_data(schema)
        self.build_layers(cfg, schema, engine=engine, rngs=rngs)

    def build_layers(
        self, cfg: Any, schema: Schema, *, engine: EngineSpec | None, rngs: nnx.Rngs
    ) -> None:
        """Builds the family's layers after its tables (``engine``: for tables of its own, as
        FinalMLP's feature gates have)."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, cfg: Any, schema: Schema, rngs: nnx.Rngs) -> FamilyModel:
        """The trainer's hook (``PACKAGE.model.build_model``): the network of a run config."""
        return cls(
            cfg.model, schema, kernels=cfg.kernels, engine=EngineSpec.from_config(cfg), rngs=rngs
        )
