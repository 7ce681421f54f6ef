"""Where the notebooks (``notebooks/*.py``) find the checkout and put their runs (no jax import).

Each notebook starts with ``ROOT, RUNS = notebook.repo_root(), notebook.runs_dir()``, so the
rule is written once: the notebook works when started from the repository root or from
notebooks/, and outside a checkout (Colab) where it is started.
"""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """The checkout the working directory is in: the first of it and its parents that holds
    ``recscale/__init__.py``; outside a checkout (Colab), the working directory."""
    here = Path.cwd()
    return next(
        (p for p in (here, *here.parents) if (p / "recscale" / "__init__.py").is_file()), here
    )


def runs_dir() -> Path:
    """``runs/notebooks`` under :func:`repo_root` (ignored by git), or the folder
    ``$RECSCALE_NOTEBOOK_RUNS`` names (the tests point it at a temporary directory)."""
    return Path(os.environ.get("RECSCALE_NOTEBOOK_RUNS") or repo_root() / "runs" / "notebooks")
