"""A serving artifact's folder (issue 20): what an export writes, and how it takes the place of
``--out`` without deleting anything it did not make (issue 35).

An export writes into a new folder of its own beside ``--out`` and renames it into place
(:func:`swap_in`); an existing ``--out`` is refused unless ``--replace`` names it, and then only
a folder holding a serving artifact's files and nothing else (:data:`ARTIFACT_FILES`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from recscale.serving import next_item, rows, runtime


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArtifactParts:
    """What a task's export contributes to an artifact (``recscale.serving.export``): the
    manifest's task-specific fields (``task``, ``inputs``, ``output``, ``tables``, ...), the
    weights the programs take by name, and the serialised programs by file name."""

    manifest: dict
    weights: dict[str, np.ndarray]
    programs: dict[str, bytes]
    arrays: dict[str, np.ndarray] | None = None
    """``vocab.npz``'s arrays (the raw-row encoding), or None."""


LOADER_FILES = {
    "recscale_model.py": runtime.__file__,
    runtime.ROWS: rows.__file__,
    runtime.NEXT_ITEM: next_item.__file__,
}
"""The jax-only loader every artifact carries: its file name -> the module copied there."""
ARTIFACT_FILES = frozenset(
    {
        runtime.MANIFEST,
        runtime.WEIGHTS,
        runtime.FORWARD,
        runtime.VOCAB,
        next_item.TOP_K,
        next_item.SCORE,
        *LOADER_FILES,
    }
)
"""What an export writes: the only entries (with a ``__pycache__`` of the loader's) of a folder
``--replace`` may replace."""


def not_an_artifact(path: Path) -> str | None:
    """Why ``path`` is not a serving artifact folder export may replace, or None."""
    if path.is_symlink() or not path.is_dir():
        return "is not a folder"
    try:
        fmt = json.loads((path / runtime.MANIFEST).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        fmt = None
    if fmt != runtime.FORMAT:
        return f"has no {runtime.FORMAT} manifest.json"
    for entry in path.iterdir():
        if entry.name == "__pycache__" and not entry.is_symlink() and entry.is_dir():
            if all(p.suffix == ".pyc" and not p.is_symlink() for p in entry.iterdir()):
                continue
        elif entry.name in ARTIFACT_FILES and not entry.is_symlink() and entry.is_file():
            continue
        return f"holds {entry.name!r}, which no export writes"
    return None


def check_out(out: Path, workdir: Path, replace: bool = False) -> None:
    """``out`` may be written: it is new, or (``replace``) a serving artifact; never the run's
    folder, inside it or above it."""
    o, w = out.resolve(), workdir.resolve()
    if o == w or o in w.parents or w in o.parents:
        raise ValueError(
            f"--out {out}: must not be the run's folder {workdir}, inside it or above it"
        )
    if os.path.lexists(out):
        check_replaceable(out, replace)


def check_replaceable(out: Path, replace: bool) -> None:
    """An existing ``out`` is replaced only when asked, and only if it is a serving artifact."""
    if not replace:
        raise ValueError(f"--out {out}: exists; pass --replace to replace a serving artifact")
    why = not_an_artifact(out)
    if why:
        raise ValueError(f"--out {out}: {why}; not a serving artifact, not replacing it")


def swap_in(tmp: Path, out: Path, replace: bool) -> None:
    """Renames the finished artifact ``tmp`` to ``out``. An existing ``out`` (checked again
    here: it may have changed during the export) is moved into a fresh folder of its own first
    and deleted only once ``tmp`` is in its place; without ``replace`` an existing ``out`` is
    refused (``os.rename`` would replace an empty folder made since the first check)."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    check_replaceable(out, replace)
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".replaced", dir=out.parent))
    os.rename(out, old / out.name)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old / out.name, out)
        old.rmdir()
        raise
    shutil.rmtree(old)  # the artifact check_replaceable recognised, in the folder made for it
