"""``python -m recscale.export --workdir DIR --out MODEL [--precision P] [--table-precision
T=P ...] [--platforms cpu cuda tpu]``: a trained run as a serving artifact
(``recscale.serving.export``). The model family is read from the run's ``command.txt``
(``python -m PACKAGE.train``) and looked up in ``recscale.families``; ``python -m
PACKAGE.export`` does the same without it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tyro

from recscale import families
from recscale.families import Family
from recscale.launch import exit_at_once_on_error
from recscale.serving.export import ExportArgs, export_workdir
from recscale.train.cli import one_line_errors, print_result


def family_of(workdir: str) -> Family:
    """The family whose trainer wrote ``workdir``: the package of the last ``python -m
    PACKAGE.train`` in its ``command.txt``, which must be a registered or known family's."""
    path = Path(workdir) / "command.txt"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found: is {workdir} a recscale run directory?")
    found = re.findall(r"-m\s+([\w.]+)\.train\b", path.read_text())
    if not found:
        raise SystemExit(f"error: {path}: no 'python -m PACKAGE.train' line; use PACKAGE.export")
    try:
        return families.by_package(found[-1])
    except families.UnknownFamilyError as e:
        raise SystemExit(f"error: {path}: {e}; use PACKAGE.export") from None


def export_main(family: Family, argv: list[str] | None = None) -> dict:
    """``python -m PACKAGE.export --workdir DIR --out MODEL [...]``: the run as a serving
    artifact (``recscale.serving.export``); prints the manifest's summary as one JSON line."""
    args = tyro.cli(ExportArgs, args=argv, prog=f"python -m {family.module('export')}")
    return _export(family, args)


def _export(family: Family, args: ExportArgs) -> dict:
    with exit_at_once_on_error():
        with one_line_errors(every_value_error=True):
            manifest = export_workdir(
                family.config_cls, family.build_model, args, family=family.package
            )
        summary = {
            k: manifest[k] for k in ("format", "family", "platforms", "table_bytes", "seconds")
        }
        summary.update(
            out=args.out,
            step=manifest["source"]["step"],
            precisions={k: v["precision"] for k, v in manifest["tables"].items()},
        )
        print_result(summary)
    return manifest


def main(argv: list[str] | None = None) -> dict:
    args = tyro.cli(
        ExportArgs, args=sys.argv[1:] if argv is None else argv, prog="python -m recscale.export"
    )
    return _export(family_of(args.workdir), args)


if __name__ == "__main__":
    main()
