"""Data configuration dataclasses (no jax import: sweeps expand configs without it)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from data.roles import LOCATION, RUNTIME, field

# Per-feature cardinalities of the Criteo Kaggle display-advertising set (C1..C26), as used by
# facebookresearch/dlrm and TorchRec. Criteo categoricals are hashed into tables of these sizes.
CRITEO_KAGGLE_VOCAB_SIZES = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)
# Criteo Terabyte cardinalities capped at 40M rows (MLPerf DLRM "max_ind_range=40000000").
CRITEO_TERABYTE_VOCAB_SIZES = (
    40000000,
    39060,
    17295,
    7424,
    20265,
    3,
    7122,
    1543,
    63,
    40000000,
    3067956,
    405282,
    10,
    2209,
    11938,
    155,
    4,
    976,
    14,
    40000000,
    40000000,
    40000000,
    590152,
    12973,
    108,
    36,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """Stateless synthetic CTR data with a planted teacher (see ``data/synthetic.py``)."""

    num_dense: int = 13
    """Number of dense features (standard normal)."""
    vocab_sizes: tuple[int, ...] = (1000,) * 8
    """Rows of each sparse feature's table; its length is the number of sparse features F."""
    max_hotness: tuple[int, ...] = (1,) * 8
    """Maximum bag size per feature (same length as ``vocab_sizes``)."""
    pooling: Literal["fixed", "uniform"] = "uniform"
    """Bag-size distribution: ``fixed`` = always max_hotness; ``uniform`` = uniform on [1, max]."""
    zipf_exponent: float = 1.1
    """Id skew: P(rank r) ~ r^-s over a seeded permutation of the rows; 0 gives uniform ids."""
    teacher_dim: int = 8
    """Dimension of the teacher's latent vectors."""
    interaction_order: int = 2
    """Highest interaction order in the teacher's logit: 1 linear, 2 pairwise, 3 triple-wise,
    4 four-way."""
    order_scales: tuple[float, ...] = (1.0, 1.5, 1.0)
    """Scale of the order-1, order-2, ... terms of the teacher logit (one per order up to
    ``interaction_order``; entries beyond it are unused)."""
    positive_rate: float = 0.25
    """Approximate fraction of positive labels (sets the teacher's bias)."""
    num_eval_examples: int = 65536
    """Size of the held-out evaluation set (indices disjoint from training)."""

    def __post_init__(self):
        if len(self.vocab_sizes) != len(self.max_hotness):
            raise ValueError(
                f"vocab_sizes has {len(self.vocab_sizes)} entries but max_hotness has "
                f"{len(self.max_hotness)}"
            )
        if not 1 <= self.interaction_order <= 4:
            raise ValueError(f"interaction_order must be 1 to 4, got {self.interaction_order}")
        if len(self.order_scales) < self.interaction_order:
            raise ValueError("order_scales needs one entry per interaction order")
        if not 0.0 < self.positive_rate < 1.0:
            raise ValueError(f"positive_rate must be in (0, 1), got {self.positive_rate}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriteoConfig:
    """Options of the raw Criteo TSV reader (see ``data/criteo/``)."""

    vocab_sizes: tuple[int, ...] = CRITEO_KAGGLE_VOCAB_SIZES
    """Hash buckets of C1..C26; bucket 0 of each is reserved for a missing value."""
    hash_seed: int = 0
    """Seed of the fixed categorical hash (never Python's ``hash``)."""
    strict: bool = True
    """Strict: a malformed row raises naming file, line, column. Lenient: reject and count it."""
    rejects_path: str = ""
    """Lenient mode writes rejected rows here ('' = ``<workdir>/criteo_rejects.tsv``)."""
    max_rows: int = 0
    """Read at most this many rows per file (0 = all)."""

    def __post_init__(self):
        if len(self.vocab_sizes) != 26:
            raise ValueError(f"Criteo has 26 categorical features, got {len(self.vocab_sizes)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TabularConfig:
    """Bring-your-own tabular data from a feature spec (see ``data/tabular/``)."""

    spec: str = field("", role=LOCATION)
    """Feature spec file (.yaml/.json/.toml): files, joins, split, label and features."""
    prepared_dir: str = field("", role=RUNTIME)
    """Root of prepared datasets ('' = ``~/.cache/recscale/tabular``); each spec and file set
    gets its own fingerprinted folder, prepared on first use and reused after."""
    eval_split: Literal["valid", "test"] = "valid"
    """Prepared split evaluation reads (unless an eval file is given, e.g. ``--data-path``)."""
    workers: int = field(0, role=RUNTIME)
    """Preparation processes (0 = one per input file, at most the CPU count)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Which dataset, where it is, and how it is batched.

    Frappe and Criteo are read one of two ways. By default (``tfds_data_dir`` empty) the raw
    files are parsed into memory. With ``tfds_data_dir`` set, training reads a prepared tfds
    ``array_record`` dataset by random access instead (for sets larger than RAM, such as the full
    Criteo Kaggle log); it gives the same batches as the in-memory route for the same files and
    settings. See ``tfds_data_dir`` for how the files map to tfds splits. Kind criteo trains on
    one file, ``train_path``: Criteo Terabyte's 24 day files are read as kind tabular instead,
    with a spec from ``python -m data.tabular.presets criteo --terabyte --train 'day_*.gz'
    --out tb.yaml`` (``data/tabular/presets.py``); the tfds builder's own ``criteo_raw/terabyte``
    config (``data/tfds_builders/criteo.py``) reads them too, but only through tfds directly.

    ``train_path``, ``eval_path`` and ``tfds_data_dir`` name one kind's files (field metadata
    ``kind_file``): a command line that switches ``kind`` away from its preset's (``dlrm/frappe
    --data.kind tabular``) leaves them empty unless it sets them too
    (``recscale.config.parse_preset_cli``).
    """

    kind: Literal["synthetic", "frappe", "criteo", "tabular"] = "synthetic"
    """Dataset family."""
    train_path: str = field("", role=LOCATION, kind_file=True)
    """Training file (Frappe: ``train.csv``; Criteo: a raw TSV, optionally .gz). Unused for
    synthetic and tabular (the spec names its files)."""
    eval_path: str = field("", role=RUNTIME, kind_file=True)
    """Evaluation file of the same format as ``train_path``. Unused for synthetic; with
    ``tfds_data_dir`` it picks the eval split and may be empty (see there); for tabular, a file
    of the spec's columns read instead of the prepared ``tabular.eval_split``."""
    batch_size: int = field(256, plan_input="batch_size")
    """Global training batch size (split over hosts and the data-parallel mesh axis)."""
    eval_batch_size: int = field(4096, role=RUNTIME)
    """Global evaluation batch size; the last batch is padded with weight-0 examples."""
    shuffle_seed: int = 0
    """Seed of the training-order shuffle (a fresh permutation every epoch); for synthetic data
    it seeds the whole generated dataset (examples and teacher)."""
    synthetic: SyntheticConfig = SyntheticConfig()
    """Synthetic generator settings (kind='synthetic')."""
    criteo: CriteoConfig = CriteoConfig()
    """Criteo reader settings (kind='criteo')."""
    tabular: TabularConfig = field(TabularConfig(), identity_default=TabularConfig())
    """Feature-spec data (kind='tabular'): any CSV/TSV/Parquet CTR dataset, prepared into
    array_record shards and read by random access."""
    id_policy: Literal["reject", "hash", "modulo"] = "reject"
    """What the host-side id guard (``data/id_guard.py``) does with a sparse id outside
    ``[0, vocab_size)`` other than the pad id -1, before any batch reaches a device: ``reject``
    raises naming the feature, the value and the record; ``modulo`` maps it to
    ``id mod vocab_size``; ``hash`` to a fixed seedless splitmix64 hash mod ``vocab_size``.
    Mapped ids are counted per feature in the run's ``data_stats.json`` (``ids.mapped``)."""
    max_table_rows: int = field(0, identity_default=0)
    """Synthetic data: cap every feature's vocabulary (so its embedding table) at this many
    rows (0 = no cap): a table of V > cap ids gets cap rows and its ids are folded into them by
    ``id_policy`` ('hash' or 'modulo'; the hashing trick), counted in ``data_stats.json``
    (``ids.mapped``). The generator and its teacher are unchanged: only the model's capacity is
    (the sparse axis of ``sweeps.specs.study_grid``'s sparse/dense IsoFLOP grid)."""
    tfds_data_dir: str = field("", role=LOCATION, kind_file=True)
    """Non-empty (frappe, criteo): read a tfds array_record dataset kept under this data_dir.

    The folder of ``train_path`` is the tfds manual dir; the dataset is prepared from it on first
    use (``download_and_prepare(file_format="array_record")``, which can take an hour for
    Criteo Kaggle; on several hosts, prepare it once first) and reused afterwards as it is: after
    the raw files change, delete it to prepare it again. Training reads split ``train``;
    evaluation reads the prepared split that holds ``eval_path``'s file.

    Frappe (``frappe_bars``): ``train_path`` must be ``<dir>/train.csv``; ``train`` is that
    file, ``validation`` is ``<dir>/valid.csv`` (required) and ``test`` is ``<dir>/test.csv`` if
    present. ``eval_path`` may be any of these three files, or empty for ``valid.csv``.

    Criteo (``criteo_raw``, a config named after the files): ``train`` is the file
    ``train_path``. If ``eval_path`` is empty, ``validation`` is instead the last
    floor(rows / 7) rows of ``train_path`` and ``train`` the rest (as the builder's ``kaggle``
    config); if it is another file in the same folder, ``validation`` is that file; if it is
    ``train_path``, evaluation reads ``train``. Hashing (``criteo.vocab_sizes``,
    ``criteo.hash_seed``) and ``criteo.max_rows`` are applied when preparing and stored with
    the dataset: a prepared dataset whose values differ from this config's is an error naming
    both (use another ``tfds_data_dir``, or delete it). Preparing always reads strictly, so
    ``criteo.strict=False`` applies only to raw files read in memory (below).

    Any other eval file (an ``eval_path`` outside the dataset, or an explicit eval path such as
    ``evaluate --data-path``) is read raw into memory, with the dataset's Frappe vocabulary or
    this config's Criteo hashing.
    """

    def __post_init__(self):
        if self.batch_size < 1 or self.eval_batch_size < 1:
            raise ValueError("batch sizes must be >= 1")
        if self.kind == "tabular":
            if not self.tabular.spec:
                raise ValueError(
                    "data.kind='tabular' needs data.tabular.spec (a feature spec file)"
                )
            if self.tfds_data_dir:
                raise ValueError("data.tfds_data_dir does not apply to kind tabular")
        elif self.kind != "synthetic" and not self.train_path:
            raise ValueError(f"data.kind={self.kind!r} needs data.train_path")
        if self.id_policy not in ("reject", "hash", "modulo"):
            raise ValueError(
                f"data.id_policy must be 'reject', 'hash' or 'modulo', got {self.id_policy!r}"
            )
        if self.max_table_rows:
            if self.kind != "synthetic" or self.max_table_rows < 1:
                raise ValueError(
                    f"data.max_table_rows={self.max_table_rows}: a positive cap applies to "
                    "kind synthetic only (Criteo sets its hash buckets in criteo.vocab_sizes)"
                )
            if self.id_policy == "reject":
                raise ValueError(
                    "data.max_table_rows folds ids into fewer rows: set data.id_policy to "
                    "'hash' or 'modulo'"
                )
        if self.kind == "synthetic" and self.tfds_data_dir:
            raise ValueError("data.tfds_data_dir applies to kinds frappe and criteo, not synthetic")
