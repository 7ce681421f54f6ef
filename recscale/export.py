"""``python -m recscale.export --workdir DIR --out MODEL [--precision P] [--table-precision
T=P ...] [--platforms cpu cuda tpu]``: a trained run as a serving artifact
(``recscale.serving.export``). The model family is read from the run's ``command.txt``
(``python -m FAMILY.train``); ``python -m FAMILY.export`` does the same without it."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

from recscale.train.cli import export_main


def family_of(workdir: str) -> str:
    """The package whose trainer wrote ``workdir`` (``dlrm``, ``baselines.dcnv2``, ...)."""
    path = Path(workdir) / "command.txt"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found: is {workdir} a recscale run directory?")
    found = re.findall(r"-m\s+([\w.]+)\.train\b", path.read_text())
    if not found:
        raise SystemExit(f"error: {path}: no 'python -m FAMILY.train' line; use FAMILY.export")
    return found[-1]


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    workdir = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--workdir"), None)
    workdir = workdir or next(
        (a.split("=", 1)[1] for a in argv if a.startswith("--workdir=")), None
    )
    if workdir is None:
        return export_main("", None, None, argv, package="recscale")  # tyro says what is missing
    package = family_of(workdir)
    fam = importlib.import_module(f"{package}.export")
    return fam.main(argv)


if __name__ == "__main__":
    main()
