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


def trained_parameters(config_cls, build_model, workdir, step: int | None = None) -> dict:
    """``{name: array}`` of a run's checkpoint (the latest, or ``step``), restored on one
    device: each table whole (``table/NAME``; an engine checkpoint is re-laid out from the mesh
    and plan it was saved under) and every dense parameter by its path."""
    import numpy as np  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from recscale.serving.export import float_tables  # noqa: PLC0415
    from recscale.train.evaluation import restored  # noqa: PLC0415

    with restored(config_cls, build_model, workdir, step=step, num_devices=1) as r:
        model = nnx.merge(r.exp.graphdef, r.params, r.batch_stats)
        out = {f"table/{k}": v for k, v in float_tables(model.embeddings).items()}
        for path, v in nnx.to_flat_state(r.params):
            if "embeddings" not in path:
                out["/".join(map(str, path))] = np.asarray(v[...])
        return out
