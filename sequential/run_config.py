"""Run configs of the sequential families (no jax import): the data, the loss and the network.

A run trains on packs of whole histories (``data.sequences.Packer``, one fixed shape): its
``data.batch_size`` counts packs, each of at most ``max_sequences`` histories and
``token_budget`` tokens, and the data-parallel devices split the packs (a history never spans
two devices). Histories are cut to their most recent ``model.max_seq_len`` events.

A sweep (``sweeps.spec``) counts a run's compute in packs: one training example is one pack,
costing its real tokens times the network's FLOPs per token (``example_cost``).

Data (``data.kind``): ``planted`` (``data.sequences.planted``: training users
``[0, num_train_users)``, the generator's held-out users evaluated on every next item of their
histories, beside the Bayes-optimal loss), ``sasrec`` (a file in SASRec's format, split as
its ``data_partition``: training on each user's items but the last two, evaluation of the
validation or test item) or ``tabular`` (your own event log through a sequence spec,
``data/tabular/seq_spec.py``: CSV/TSV/Parquet, prepared once into histories, split
leave-one-out or by time, evaluation of each user's validation or test item).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import numpy as np

from data.roles import LOCATION, RUNTIME, field
from data.sequences import Histories, PackConfig, Packer, leave_one_out, read_sasrec
from data.sequences.planted import PlantedConfig, PlantedSequences
from recscale.config import ConfigError, EmbeddingShardingConfig, ExperimentConfig
from recscale.flops import ModelCost
from sequential.config import BagConfig, HSTUConfig, LossConfig, SASRecConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceTabularConfig:
    """An event log read through a sequence spec (``data/tabular/seq_spec.py``); the flags are
    the CTR families' ``--data.tabular.*``."""

    spec: str = field("", role=LOCATION)
    """Sequence spec file (.yaml/.json/.toml): files, user, item, time, side columns, split."""
    prepared_dir: str = field("", role=RUNTIME)
    """Root of prepared data ('' = ``~/.cache/recscale/tabular``); each spec and file set gets
    its own fingerprinted folder, prepared on first use and reused after."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceDataConfig:
    """Which histories, and how they are packed (module docstring)."""

    kind: Literal["planted", "sasrec", "tabular"] = "planted"
    """``planted``: generated histories with a known Bayes-optimal loss; ``sasrec``: a file in
    SASRec's ``user item`` format (``sasrec_path``); ``tabular``: an event log of a sequence
    spec (``tabular.spec``)."""
    sasrec_path: str = field("", role=LOCATION)
    """kind sasrec: the file (e.g. ``data/Video.txt`` of github:kang205/SASRec, read in place)."""
    tabular: SequenceTabularConfig = field(
        SequenceTabularConfig(), identity_default=SequenceTabularConfig()
    )
    """kind tabular: the sequence spec and where its prepared histories go."""
    planted: PlantedConfig = PlantedConfig()
    """kind planted: the generator (its ``n_items`` must be ``model.n_items``)."""
    num_train_users: int = 65536
    """kind planted: training users (indices ``[0, num_train_users)``, one epoch of packs)."""
    batch_size: int = 1
    """Packs per training step (split over the data-parallel devices)."""
    eval_batch_size: int = field(1, role=RUNTIME)
    """Packs per evaluation step; the last step is padded with empty packs."""
    token_budget: int = 8192
    """Most real tokens in a pack."""
    max_sequences: int = 256
    """Most histories in a pack (B)."""
    block_size: int = 128
    """A pack's token slots are ``token_budget`` rounded up to a multiple of this."""
    eval_split: Literal["valid", "test"] = "valid"
    """kinds sasrec and tabular: the held-out item evaluated (``valid``: after the training
    items; ``test``: after those and the validation item, or, split by time, each user's first
    item at or after ``test_from``)."""
    eval_users: int = 0
    """Evaluate this many held-out users, a fixed seeded sample (0: all). SASRec's own
    ``evaluate`` scores 10,000 sampled users where there are more (a new sample each time)."""
    sampled_negatives: int = 0
    """Also rank each held-out item among this many sampled negatives (SASRec's protocol, 100
    in its paper; ``sequential.metrics.sasrec_negatives``); 0: full ranking only."""
    shuffle_seed: int = 0
    """Seed of the packs' epoch order, of the planted generator and of the sampled negatives."""

    def __post_init__(self):
        for name in ("num_train_users", "batch_size", "eval_batch_size", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_sequences < 1 or self.block_size < 1:
            raise ValueError("data.max_sequences and data.block_size must be >= 1")
        if self.sampled_negatives < 0 or self.eval_users < 0:
            raise ValueError("data.sampled_negatives and data.eval_users must be >= 0")
        if self.kind == "planted" and self.eval_split != "valid":
            raise ValueError(
                f"data.eval_split={self.eval_split!r}: planted data holds out whole users, not "
                "a split of each history (kinds sasrec and tabular have splits)"
            )
        if self.kind == "tabular" and not self.tabular.spec:
            raise ValueError(
                "data.kind='tabular' needs data.tabular.spec (a sequence spec file: "
                "--data.tabular.spec SPEC.yaml)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequentialConfig(ExperimentConfig):
    """A sequential recommender's run: packs of histories, a next-item loss, ranking metrics.
    Its item table is one ``EmbeddingCollection`` table: in the sharded embedding engine
    (``embeddings.sharding`` row_wise, table_wise, data_parallel, auto, ...; sparse row updates
    by ``embedding_optim``) or one array on the per-table path (``off``; optax)."""

    data: SequenceDataConfig = SequenceDataConfig()
    """Histories and their packing."""
    loss: LossConfig = LossConfig()
    """The training loss (``sequential.losses``)."""
    embeddings: EmbeddingShardingConfig = EmbeddingShardingConfig(sharding="off")
    """The item table's storage (``sequential.task``: a step's ids in one lookup); the per-table
    path (``off``) by default."""

    def __post_init__(self):
        d, n_items = self.data, self.model.n_items
        if d.kind == "planted" and d.planted.n_items != n_items:
            raise ValueError(
                f"data.planted.n_items={d.planted.n_items} but model.n_items={n_items}: "
                "set both to the same V"
            )

    def task(self):
        """The trainer's hooks of this run (``recscale.train.task``; imports jax)."""
        from sequential.task import SequentialTask  # noqa: PLC0415  (jax, on first use)

        return SequentialTask(self)

    def example_cost(self) -> ModelCost:
        """Parameters and costs of one training *pack* (a sweep's example): the network's costs
        per token (``model.cost`` with this run's loss) at the token-weighted history length
        of the training packs, times their mean real tokens (``pack_stats``). Expected
        values over the first epoch; the train rows log what each step actually cost."""
        tokens, seq_len = pack_stats(self)
        c = self.model.cost(seq_len=seq_len, loss=self.loss)
        return dataclasses.replace(
            c,
            forward_flops=tokens * c.forward_flops,
            backward_flops=tokens * c.backward_flops,
            embedding_bytes_read=tokens * c.embedding_bytes_read,
            components=tuple((name, tokens * f) for name, f in c.components),
        )


def train_lengths(d: SequenceDataConfig) -> np.ndarray:
    """int64 [U]: the length of every training history, before any cut (planted: from the
    generator's latents, without drawing items; sasrec: the file's leave-one-out training
    part)."""
    if d.kind == "planted":
        gen = PlantedSequences(d.planted, seed=d.shuffle_seed)
        return gen.user_latents(np.arange(d.num_train_users, dtype=np.int64))[1]
    if not os.path.isfile(d.sasrec_path):
        raise ConfigError(f"data.sasrec_path={d.sasrec_path!r}: no such file")
    return leave_one_out(read_sasrec(d.sasrec_path)).train.lengths().astype(np.int64)


def pack_stats(cfg: SequentialConfig) -> tuple[float, float]:
    """``(tokens, seq_len)`` of a run's training packs over their first epoch: the mean real
    tokens per pack, and the token-weighted mean history length ``Σ n² / Σ n`` (the length at
    which the per-token cost, affine in it, gives the packs' total exactly; ``sequential.task``
    logs the same per step). Histories are cut to ``model.max_seq_len``, then packed as
    ``sequential.source`` packs them (the packing reads lengths only: the items here are
    placeholders)."""
    d = cfg.data
    n = np.minimum(train_lengths(d), min(cfg.model.max_seq_len, d.token_budget))
    total = int(n.sum())
    hist = Histories(
        items=np.ones(total, np.int32),
        offsets=np.concatenate([[0], np.cumsum(n)]).astype(np.int64),
        user_raw=np.arange(n.shape[0]),
        item_raw=np.ones(1, np.int64),
    )
    pack = PackConfig(
        token_budget=d.token_budget, max_sequences=d.max_sequences, block_size=d.block_size
    )
    packs = Packer(hist, pack, seed=d.shuffle_seed).num_batches(0)
    return total / packs, float((n * n).sum()) / total


@dataclasses.dataclass(frozen=True, kw_only=True)
class HSTURunConfig(SequentialConfig):
    """A whole HSTU run."""

    model: HSTUConfig = HSTUConfig(n_items=10_000)
    """The network."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SASRecRunConfig(SequentialConfig):
    """A whole SASRec run."""

    model: SASRecConfig = SASRecConfig(n_items=10_000)
    """The network."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BagRunConfig(SequentialConfig):
    """A whole run of the bag baseline."""

    model: BagConfig = BagConfig(n_items=10_000)
    """The network."""
