"""Bring-your-own tabular data: a feature spec (``spec.py``) read with pyarrow (``read.py``),
encoded (``encode.py``) and prepared into array_record shards (``prepare.py``); proposed from a
sample by ``python -m data.tabular.inspect``. Event logs for the sequential families: a sequence
spec (``seq_spec.py``) prepared into per-user histories (``seq_prepare.py``)."""

from data.tabular.prepare import Prepared, prepare
from data.tabular.read import TabularFormatError
from data.tabular.seq_prepare import PreparedSequences, prepare_sequences
from data.tabular.seq_spec import SequenceSpec, load_sequence_spec
from data.tabular.spec import (
    Feature,
    FileFormat,
    Join,
    Label,
    SpecError,
    Split,
    TabularSpec,
    load_spec,
)

__all__ = [
    "Feature",
    "FileFormat",
    "Join",
    "Label",
    "Prepared",
    "PreparedSequences",
    "SequenceSpec",
    "Split",
    "SpecError",
    "TabularFormatError",
    "TabularSpec",
    "load_sequence_spec",
    "load_spec",
    "prepare",
    "prepare_sequences",
]
