"""``python -m sequential.bag.export --workdir DIR --out MODEL [--platforms ...]``: a trained run
as a next-item serving artifact (``sequential.serving``; ``python -m recscale.export`` finds
the family itself)."""

from __future__ import annotations

from recscale.export import export_main
from sequential.bag import FAMILY


def main(argv: list[str] | None = None) -> dict:
    return export_main(FAMILY, argv)


if __name__ == "__main__":
    main()
