"""Bring-your-own tabular data: a feature spec (``spec.py``) read with pyarrow (``read.py``),
encoded (``encode.py``) and prepared into array_record shards (``prepare.py``); proposed from a
sample by ``python -m data.tabular.inspect``."""

from data.tabular.prepare import Prepared, prepare
from data.tabular.read import TabularFormatError
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
    "Split",
    "SpecError",
    "TabularFormatError",
    "TabularSpec",
    "load_spec",
    "prepare",
]
