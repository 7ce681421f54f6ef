"""The Frappe CTR dataset (BARS ``Frappe_x1`` CSV layout): vocabulary, schema and reader."""

from data.frappe.reader import (
    FRAPPE_COLUMNS,
    FRAPPE_FIELDS,
    FRAPPE_HEADER,
    FrappeFormatError,
    FrappeStats,
    FrappeVocab,
    build_frappe_vocab,
    frappe_schema,
    map_frappe_table,
    parse_frappe_csv,
    read_frappe,
)

__all__ = [
    "FRAPPE_COLUMNS",
    "FRAPPE_FIELDS",
    "FRAPPE_HEADER",
    "FrappeFormatError",
    "FrappeStats",
    "FrappeVocab",
    "build_frappe_vocab",
    "frappe_schema",
    "map_frappe_table",
    "parse_frappe_csv",
    "read_frappe",
]
