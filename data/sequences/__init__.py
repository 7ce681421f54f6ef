"""Ordered per-user interaction histories for sequential recommenders (SASRec, HSTU).

Modules: ``histories`` (the jagged :class:`Histories` and building it from an event log),
``sasrec`` (SASRec's ``user item`` text files and its leave-one-out partition), ``splits``
(leave-one-out and global time cutoff), ``jagged`` (token-budget packing into fixed-shape
:class:`JaggedBatch` es), ``planted`` (a stateless generator of histories with a known
Bayes-optimal next-item loss). No jax import: a ``JaggedBatch`` is a NamedTuple, a pytree as is.

Item ids are ``1..V``; 0 is the padding id everywhere in this package.
"""

from data.sequences.histories import (
    Histories,
    HistoryCounters,
    HistoryError,
    build_histories,
    histories_from_arrow,
)
from data.sequences.jagged import JaggedBatch, PackConfig, Packer
from data.sequences.planted import PlantedConfig, PlantedSequences
from data.sequences.sasrec import SasrecFormatError, data_partition, read_sasrec
from data.sequences.splits import LeaveOneOut, TimeCutoff, leave_one_out, time_cutoff

__all__ = [
    "Histories",
    "HistoryCounters",
    "HistoryError",
    "JaggedBatch",
    "LeaveOneOut",
    "PackConfig",
    "Packer",
    "PlantedConfig",
    "PlantedSequences",
    "SasrecFormatError",
    "TimeCutoff",
    "build_histories",
    "data_partition",
    "histories_from_arrow",
    "leave_one_out",
    "read_sasrec",
    "time_cutoff",
]
