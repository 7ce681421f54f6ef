"""Reading a run directory back in tests: metrics.jsonl rows and checkpoint items."""

from __future__ import annotations

import json
from pathlib import Path


def metric_rows(workdir, split: str = "train") -> list[dict]:
    """The rows of ``<workdir>/metrics.jsonl`` of ``split``, in file order."""
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def checkpoint_item(workdir, step: int, item: str = "params"):
    """Item ``item`` of checkpoint ``step`` of a run, read by orbax alone (no checks)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    path = Path(workdir) / "checkpoints" / str(step) / item
    with ocp.StandardCheckpointer() as c:
        return c.restore(path.absolute())
